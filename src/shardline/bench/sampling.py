"""What sampling costs per token on the sampling rank: ``python -m shardline.bench.sampling``.

Runs :class:`shardline.runner.sampling.Sampler` on float32 logits rows of SmolLM2's
vocabulary (49,152 tokens) on the CPU, as the sampling rank does for each sequence each
step, and prints the time per token of:

- plain greedy (argmax of the untouched logits: today's path);
- greedy + penalties (frequency 0.5, presence 0.3, repetition 1.1 over a 512-token prompt);
- greedy + logprobs(5);
- greedy + a JSON-schema grammar (llguidance's mask for SmolLM2's tokenizer, applied to the
  row, then the matcher consuming the token);
- all of them together;

as ms/token, the time added to plain greedy, and the ratio. The grammar's tokenizer (built
once per runner) and matcher construction (once per request) are timed apart. The logits
are random (the cost does not depend on their values); a constrained sequence that
finishes its JSON starts a new one (its matcher construction is then counted in).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Callable

import torch

from shardline.runner.constraint import Constraint, GrammarTokenizer
from shardline.runner.protocol import SamplingParams
from shardline.runner.sampling import Sampler

VOCAB = 49152
STOP = 2  # SmolLM2's <|im_end|>

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
    },
    "required": ["name", "age", "tags"],
}


def per_token_ms(make: Callable[[], Sampler], rows: list[torch.Tensor], passes: int) -> float:
    """Mean milliseconds of one ``Sampler.choose`` over ``rows``, ``passes`` times, a new
    sampler from ``make()`` whenever the last one picked the stop token."""
    sampler = make()
    for row in rows[:20]:  # warm up
        sampler.choose(row)
    sampler = make()
    count = 0
    started = time.perf_counter()
    for _ in range(passes):
        for row in rows:
            if sampler.choose(row).token == STOP:
                sampler = make()
            count += 1
    return (time.perf_counter() - started) / count * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=500, help="logits rows per pass")
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (runners in tests: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from shardline.api.structured import json_grammar
    from shardline.models.store import default_model_path

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(VOCAB, generator=gen) * 3 for _ in range(args.tokens)]
    prompt = tuple(torch.randint(0, VOCAB, (512,), generator=gen).tolist())
    started = time.perf_counter()
    tokenizer = GrammarTokenizer(str(default_model_path()))
    tokenizer()
    tokenizer_s = time.perf_counter() - started
    grammar = json_grammar(SCHEMA)
    started = time.perf_counter()
    for _ in range(20):
        Constraint.start(grammar, tokenizer, (STOP,))
    matcher_ms = (time.perf_counter() - started) / 20 * 1e3

    greedy = SamplingParams(temperature=0.0)
    penalised = replace(greedy, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)
    cases: list[tuple[str, Callable[[], Sampler]]] = [
        ("greedy", lambda: Sampler(greedy, prompt)),
        ("+ penalties", lambda: Sampler(penalised, prompt)),
        ("+ logprobs(5)", lambda: Sampler(replace(greedy, logprobs=5), prompt)),
        ("+ JSON schema", lambda: Sampler(greedy, prompt, Constraint.start(grammar, tokenizer, (STOP,)))),
        (
            "all of them",
            lambda: Sampler(replace(penalised, logprobs=5), prompt, Constraint.start(grammar, tokenizer, (STOP,))),
        ),
    ]
    print(f"vocab {VOCAB}, {args.tokens} tokens x {args.passes} passes, {args.threads} thread(s)")
    print(f"grammar tokenizer built once per runner: {tokenizer_s:.2f} s; matcher per request: {matcher_ms:.2f} ms")
    print(f"{'sampling':>14} {'ms/token':>9} {'added ms':>9} {'ratio':>6}")
    base = 0.0
    for label, make in cases:
        ms = per_token_ms(make, rows, args.passes)
        base = base or ms
        print(f"{label:>14} {ms:9.4f} {ms - base:9.4f} {ms / base:6.1f}")


if __name__ == "__main__":
    main()
