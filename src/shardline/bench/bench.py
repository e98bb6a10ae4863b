"""``shardline bench``: prefill tokens/s, decode tokens/s and TTFT of a (local) cluster."""

from __future__ import annotations

def add_arguments(parser) -> None:
    pass

def main(args) -> int:
    return 0
