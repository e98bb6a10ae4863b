"""A prefill chunk's attention, torch's against the compiled one:
``python -m shardline.bench.prefill_attention``.

For each ``--rows`` x ``--start`` (a chunk of that many rows whose first is at that
position, the keys before it cached) and a head shape (``--heads``, ``--kv-heads``,
``--head-dim``; SmolLM2-135M's 9 / 3 / 64 by default), times one layer's attention in
bfloat16 through torch's ``scaled_dot_product_attention`` as the torch layers call it
(over the keys up to the chunk's last row, or with ``--span`` up to the next multiple of
it, the prefix cache's key span) and through
:func:`shardline.models.prefill_attention.attend`. The two alternate, A B A B; each figure
is the median of ``--rounds``. The keys, values and queries are random (the cost does not
depend on them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from shardline.models import prefill_attention


def torch_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, span: int) -> float:
    """One torch attention call of chunk ``q`` ``[rows, heads, hd]`` at ``start``, ms."""
    rows = q.shape[0]
    end = start + rows
    keys = min(-(-end // span) * span, k.shape[2]) if span else end
    mask = torch.arange(keys).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
    began = time.perf_counter()
    F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k[:1, :, :keys], v[:1, :, :keys], attn_mask=mask, enable_gqa=True
    )
    return (time.perf_counter() - began) * 1e3


def compiled_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> float:
    """One compiled attention call of chunk ``q`` at ``start``, ms."""
    began = time.perf_counter()
    prefill_attention.attend(q, k, v, 0, start)
    return (time.perf_counter() - began) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[96, 232, 512])
    parser.add_argument("--start", type=int, nargs="+", default=[0, 2089])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--span", type=int, default=0, help="torch's keys to a multiple of this (0: none)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not prefill_attention.built():
        raise SystemExit("the compiled prefill attention does not run here (AVX-512 BF16 and a C compiler)")
    positions = max(args.start) + max(args.rows) + args.span
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.kv_heads, positions, args.head_dim)
    k = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v = torch.randn(shape, generator=gen).to(torch.bfloat16)
    print(
        f"threads {torch.get_num_threads()}; heads {args.heads} / {args.kv_heads} of {args.head_dim}; "
        f"medians of {args.rounds}"
    )
    print(f"{'rows':>5} {'start':>6} {'torch ms':>9} {'compiled ms':>12} {'ratio':>6}")
    for start in args.start:
        for rows in args.rows:
            q = torch.randn(rows, args.heads, args.head_dim, generator=gen).to(torch.bfloat16)
            torch_ms(q, k, v, start, args.span), compiled_ms(q, k, v, start)  # warm up
            a, b = [], []
            for _ in range(args.rounds):
                a.append(torch_ms(q, k, v, start, args.span))
                b.append(compiled_ms(q, k, v, start))
            ta, tb = statistics.median(a), statistics.median(b)
            print(f"{rows:>5} {start:>6} {ta:>9.2f} {tb:>12.2f} {ta / tb:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
