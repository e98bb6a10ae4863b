"""What a decode step's weight products cost: ``python -m shardline.bench.decode_kernel``.

Times the int4-plane products of one SmolLM2-135M decode step (30 layers of a fused q/k/v
576 -> 960, the output projection 576 -> 576, a fused gate/up 576 -> 3072 and the down
projection 1536 -> 576, each one Q4_1-like plane, and the tied Q8_0 LM head 576 -> 49152
as two planes) with 1, 4 and 8 rows of bfloat16 activations, through torch's CPU int4
kernel (``torch._weight_int4pack_mm_for_cpu``, one call per plane, summed: the path before
the compiled decode product) and through the compiled product
(:class:`shardline.models.native_dequant.Int4Gemv`). The two alternate, A B A B, and
each figure is the median of the rounds; it prints ms per step for each, the ratio torch /
compiled, and each path's cost at ``r`` rows over its cost at one row.

The weights are random (the cost does not depend on the values).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from shardline.models import native_dequant
from shardline.models.int4_planes import INT4_GROUP

LAYERS = 30
SHAPES = [  # (name, out, in, planes, per step)
    ("qkv", 960, 576, 1, LAYERS),
    ("o", 576, 576, 1, LAYERS),
    ("gate_up", 3072, 576, 1, LAYERS),
    ("down", 576, 1536, 1, LAYERS),
    ("head", 49152, 576, 2, 1),
]


def random_planes(out: int, k: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` int4 planes ``[out, k]`` in torch's CPU layout with bfloat16 scales (a
    second plane's 16 times the first's, as an 8-bit type's high nibbles)."""
    gen = torch.Generator().manual_seed(seed)
    scale = (torch.randn(k // INT4_GROUP, out, generator=gen) * 0.01).to(torch.bfloat16)
    planes = []
    for i in range(count):
        q = torch.randint(0, 16, (out, k), generator=gen, dtype=torch.int32)
        zero = (torch.randn(k // INT4_GROUP, out, generator=gen) * 0.01).to(torch.bfloat16)
        sz = torch.stack((scale * 16**i, zero), dim=-1).contiguous()
        planes.append((torch._convert_weight_to_int4pack_for_cpu(q, 1), sz))
    return planes


def torch_product(planes: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """The product through torch's int4 kernel, one call per plane."""
    y = None
    for packed, sz in planes:
        part = torch._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, sz)
        y = part if y is None else y + part
    assert y is not None
    return y


def step_ms(
    products: list[Callable[[torch.Tensor], torch.Tensor]], inputs: dict[int, torch.Tensor], repeat: int
) -> float:
    """Milliseconds of one decode step's products (``repeat`` steps, mean): ``products``
    per :data:`SHAPES` entry."""
    started = time.perf_counter()
    for _ in range(repeat):
        for (_, _, k, _, times), product in zip(SHAPES, products):
            x = inputs[k]
            for _ in range(times):
                product(x)
    return (time.perf_counter() - started) / repeat * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=5, help="A B alternations")
    parser.add_argument("--repeat", type=int, default=3, help="steps per timing")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native_dequant.int4_gemv_built():
        raise SystemExit(
            "the compiled int4 decode product is not built on this machine "
            "(it needs AVX-512 VNNI and VBMI and a C compiler)"
        )
    weights = [random_planes(out, k, count, seed) for seed, (_, out, k, count, _) in enumerate(SHAPES)]
    paths: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "torch": [functools.partial(torch_product, planes) for planes in weights],
        "compiled": [native_dequant.Int4Gemv(planes) for planes in weights],
    }
    print(
        f"threads {torch.get_num_threads()}; one step = {LAYERS} layers + LM head; "
        f"medians of {args.rounds} alternations"
    )
    print(
        f"{'rows':>4} {'torch ms':>9} {'compiled ms':>12} {'torch/compiled':>15}"
        f" {'torch vs 1 row':>15} {'compiled vs 1 row':>18}"
    )
    one: dict[str, float] = {}
    for rows in args.rows:
        gen = torch.Generator().manual_seed(rows)
        inputs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for products in paths.values():  # warm up
            step_ms(products, inputs, 1)
        for _ in range(args.rounds):
            for name, products in paths.items():
                times[name].append(step_ms(products, inputs, args.repeat))
        med = {name: statistics.median(t) for name, t in times.items()}
        one = one or med
        print(
            f"{rows:>4} {med['torch']:>9.2f} {med['compiled']:>12.2f} "
            f"{med['torch'] / med['compiled']:>15.2f} {med['torch'] / one['torch']:>15.2f} "
            f"{med['compiled'] / one['compiled']:>18.2f}"
        )


if __name__ == "__main__":
    main()
