"""A whole decode step, torch path against fused decode layers:
``python -m shardline.bench.decode_step``.

Loads the embedded SmolLM2-135M GGUF (or ``--model PATH``, any model file or folder
shardline reads) as a one-node shard in bfloat16 and times one
decode step (embedding, the layers, final norm and LM head) for ``rows`` sequences
whose caches hold ``context`` positions (filled with random keys and values: attention
costs the same whatever they are), or with ``--drafted`` for one sequence's ``rows``
rows at positions ``context ..`` (a speculative step's drafted rows), through the
layers' torch ops (the reference) and through the fused decode layers
(:mod:`shardline.models.fused_decode`), and the step's weight products alone (each
weight part's decode product on the same rows: SmolLM2's 121 calls of the compiled int4
product, the LM head's included). The three alternate, A B C A B C, and each figure is
the median of the rounds; it prints ms per step for each, the ratio torch / fused, and
the time beside the products (step minus products) on each path with its ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from shardline.models.int4_planes import Int4Planes
from shardline.models.kv_cache import KVCache
from shardline.models.linear import Linear
from shardline.models.shard_loader import load_shard
from shardline.models.store import default_model_path
from shardline.models.weights import open_weights


def step_ms(shard, cache: KVCache, rows: int, context: int, repeat: int, drafted: bool = False) -> float:
    """Milliseconds of one decode step of ``rows`` sequences at position ``context``, or
    with ``drafted`` of one sequence's rows at positions ``context .. context + rows - 1``
    (``repeat`` steps, median)."""
    ids = torch.arange(rows) + 100
    slots, positions = (
        ([0] * rows, [context + i for i in range(rows)]) if drafted else (list(range(rows)), [context] * rows)
    )
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        batch = shard.decode_batch(slots, positions)
        shard(ids, batch, cache)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


Product = tuple[int, Callable[[torch.Tensor], torch.Tensor]]
"""A weight part's input width and its decode product (bfloat16 ``[rows, K]`` in)."""


def products(shard) -> list[Product]:
    """Every weight part of ``shard``'s products with its decode product: the compiled
    int4 product where the part has one, else the part's own ``matmul``."""
    found: list[Product] = []
    for module in shard.modules():
        if isinstance(module, Linear):
            for part in module.parts:
                gemv = part._gemv() if isinstance(part, Int4Planes) else None
                found.append((part.shape[1], gemv or part.matmul))
    return found


def products_ms(parts: list[Product], rows: int, repeat: int) -> float:
    """Milliseconds of a step's weight products alone, ``parts`` (each called once on
    ``rows`` rows; ``repeat`` steps, median)."""
    inputs = {K: torch.randn(rows, K).to(torch.bfloat16) for K, _ in parts}
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        for K, product in parts:
            product(inputs[K])
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--rounds", type=int, default=5, help="A B alternations")
    parser.add_argument("--repeat", type=int, default=5, help="steps per timing")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument(
        "--drafted", action="store_true", help="the rows are one sequence's, at consecutive positions (drafted tokens)"
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="a model file or folder (default: the embedded SmolLM2-135M)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    if not path.exists():
        raise SystemExit(f"--model {path}: no such file or folder")
    source = open_weights(path)
    shard = load_shard(source, 0, source.config.num_layers, dtype=torch.bfloat16)
    fused = shard.fused
    if fused is None:
        raise SystemExit("the fused decode layers do not run here (see the log line above)")
    cache = KVCache(
        source.config, source.config.num_layers, max(args.rows), max(args.context) + max(args.rows), torch.bfloat16
    )
    gen = torch.Generator().manual_seed(0)
    for t in cache.k + cache.v:
        t[:, :, : max(args.context)] = (torch.randn(t[:, :, : max(args.context)].shape, generator=gen) * 0.5).to(
            t.dtype
        )
    rows_are = "one sequence's drafted rows" if args.drafted else "a row a sequence"
    print(
        f"threads {torch.get_num_threads()}; {path.name} bfloat16, one node; {rows_are}; "
        f"medians of {args.rounds} alternations x {args.repeat} steps"
    )
    parts = products(shard)
    print(
        f"{'rows':>4} {'context':>7} {'torch ms':>9} {'fused ms':>9} {'torch/fused':>12}"
        f" {'products ms':>12} {'torch beside':>13} {'fused beside':>13} {'ratio':>6}"
    )
    paths = {"torch": None, "fused": fused}
    for context in args.context:
        for rows in args.rows:
            times: dict[str, list[float]] = {name: [] for name in [*paths, "products"]}
            for path in paths.values():  # warm up
                shard.fused = path
                step_ms(shard, cache, rows, context, 1, args.drafted)
            for _ in range(args.rounds):
                for name, path in paths.items():
                    shard.fused = path
                    times[name].append(step_ms(shard, cache, rows, context, args.repeat, args.drafted))
                times["products"].append(products_ms(parts, rows, args.repeat))
            med = {name: statistics.median(t) for name, t in times.items()}
            beside = {name: med[name] - med["products"] for name in paths}
            print(
                f"{rows:>4} {context:>7} {med['torch']:>9.2f} {med['fused']:>9.2f} "
                f"{med['torch'] / med['fused']:>12.2f} {med['products']:>12.2f} "
                f"{beside['torch']:>13.2f} {beside['fused']:>13.2f} "
                f"{beside['torch'] / beside['fused']:>6.1f}",
                flush=True,
            )
    shard.fused = fused


if __name__ == "__main__":
    main()
