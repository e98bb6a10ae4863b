"""The prefix cache on the default model (SmolLM2-135M Q4_1), or ``--model``'s, in bfloat16
in this process (one engine per setting, 512-token chunks as a runner cuts them).

    PYTHONPATH=src python scripts/prefix_cache_check.py exact [--threads 1] [--naive]
        [--prompts 20] [--model PATH]
    PYTHONPATH=src python scripts/prefix_cache_check.py turns [--threads 1]
        [--conversations 3] [--model PATH]

``exact``: 20 prompts (``--prompts``) of 416-1,674 tokens; each prefilled cold on one
engine, and on another after a prompt that is its first 200-1,600 tokens (a hit); prints
whether their 16 greedy tokens are the same. ``--naive`` resumes at the longest match and caches every
prefilled row, each piece computed as its own rows and without the key span (what
:mod:`shardline.runner.prefix_cache`, ``ForwardBatch.computed_as`` and
:func:`shardline.parallel.stage.span_keys` prevent).

``turns``: conversations of 8 turns, each adding 250 new tokens to the prompt and then the
64-token answer, on an engine with the cache and one without, turn by turn (which goes
first alternating); prints each turn's time to the first token and the medians.
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import time

import torch

from shardline.models.kv_cache import KVCache
from shardline.models.shard_loader import load_shard
from shardline.models.store import default_model_path
from shardline.models.weights import open_weights
from shardline.parallel.pipeline import PipelineStage
from shardline.runner.engine import Engine
from shardline.runner.protocol import SamplingParams, Task, TokenEvent, Tokens

GREEDY = SamplingParams(temperature=0.0)


class Runner:
    """One engine over the shard, run in this process until each task ends."""

    def __init__(self, shard, config, prefix_cache: bool) -> None:
        self.sent: list = []
        cache = KVCache(config, len(shard.layers), 8, 4096, torch.bfloat16)
        self.engine = Engine(
            PipelineStage(shard, cache, 0, 1),
            queue.Queue(),
            self.sent.append,
            "n",
            None,
            8,
            4096,
            512,
            512,
            4096,
            prefix_cache=prefix_cache,
        )
        self.ids = iter(range(1, 1 << 40))

    def run(self, prompt, max_tokens: int) -> tuple[float, list[int], int]:
        """(seconds to the first token, the tokens, the cached tokens)."""
        self.engine.inbox.put(Task(next(self.ids), "n", tuple(prompt), max_tokens, GREEDY))
        start, first, tokens = time.perf_counter(), None, []
        while True:
            self.engine.step()
            for message in self.sent:
                for event in message.events if isinstance(message, Tokens) else ():
                    if isinstance(event, TokenEvent):
                        first = first or time.perf_counter() - start
                        tokens.append(event.token_id)
                        if event.finish_reason is not None:
                            self.sent.clear()
                            return first, tokens, event.cached_tokens
            self.sent.clear()


def naive() -> None:
    import shardline.parallel.stage as stage
    import shardline.runner.engine as engine
    import shardline.runner.prefix_cache as prefix_cache

    prefix_cache.reuse = lambda matched, total, chunk: min(matched, total - 1)
    engine.exact_end = lambda end, start, length, chunk, computed_as: start + length if start == end else end  # type: ignore[assignment]
    engine.Engine._computed_as = lambda self, seq, chunk: 0  # type: ignore[method-assign]
    stage.span_keys = lambda batch, span, positions: batch  # type: ignore[assignment]


def exact(shard, config, prompts: int) -> None:
    rng = random.Random(1)
    cold, warm = Runner(shard, config, True), Runner(shard, config, True)
    differ = 0
    for i in range(prompts):
        prefix = [rng.randrange(1000, 40000) for _ in range(rng.randrange(200, 1600))]
        prompt = prefix + [rng.randrange(1000, 40000) for _ in range(rng.randrange(20, 400))]
        _, mine, _ = cold.run(prompt, 16)
        warm.run(prefix, 1)
        _, theirs, cached = warm.run(prompt, 16)
        differ += mine != theirs
        print(
            f"{i:2d}: prefix {len(prefix):4d}, prompt {len(prompt):4d}, cached {cached:4d}: "
            f"{'same' if mine == theirs else 'differs'}",
            flush=True,
        )
    print(f"{differ} of {prompts} differ")


def turns(shard, config, conversations: int) -> None:
    per_turn: list[list[tuple[int, int, float, float]]] = [[] for _ in range(8)]
    for c in range(conversations):
        rng = random.Random(7 + c)
        on, off = Runner(shard, config, True), Runner(shard, config, False)
        prompts = {id(on): [rng.randrange(1000, 40000) for _ in range(40)]}
        prompts[id(off)] = list(prompts[id(on)])
        for i in range(8):
            user = [rng.randrange(1000, 40000) for _ in range(250)]
            times, cached = {}, 0
            for r in (on, off) if (c + i) % 2 == 0 else (off, on):
                prompts[id(r)] += user
                times[id(r)], answer, got = r.run(prompts[id(r)], 64)
                cached = got if r is on else cached
                prompts[id(r)] += answer
            a, b = times[id(on)], times[id(off)]
            per_turn[i].append((len(prompts[id(on)]) - 64, cached, a, b))
            print(
                f"conversation {c} turn {i + 1}: prompt {per_turn[i][-1][0]:5d}, cached {cached:5d}: "
                f"TTFT {a * 1000:6.0f} ms with the cache, {b * 1000:6.0f} ms without ({a / b:.2f}x)",
                flush=True,
            )
    print(f"medians over {conversations} conversations:")
    for i, rows in enumerate(per_turn):
        a, b = statistics.median(r[2] for r in rows), statistics.median(r[3] for r in rows)
        print(
            f"turn {i + 1}: prompt {rows[0][0]:5d}, cached {rows[0][1]:5d}: TTFT {a * 1000:6.0f} ms with the "
            f"cache, {b * 1000:6.0f} ms without ({a / b:.2f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("exact", "turns"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--naive", action="store_true")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=20, help="exact: prompts compared")
    parser.add_argument("--model", help="a GGUF or safetensors model (default: the default model)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.naive:
        naive()
    source = open_weights(args.model or default_model_path())
    shard = load_shard(source, 0, source.config.num_layers, dtype=torch.bfloat16)
    if args.what == "exact":
        exact(shard, source.config, args.prompts)
    else:
        turns(shard, source.config, args.conversations)


if __name__ == "__main__":
    main()
