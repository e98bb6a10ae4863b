"""Sets of byte ranges of a file: ``[start, end)`` pairs, kept sorted and merged.

What a node holds of a file it copied in part (:mod:`shardline.models.sparse_file`), what
a rank needs of it, and what is left to copy are such sets. Pure functions over lists of
pairs; an empty range (``start == end``) is no bytes and is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

Range = tuple[int, int]
"""``(start, end)``: the bytes ``start`` to ``end - 1`` of a file."""


def merged(ranges: Iterable[Range]) -> list[Range]:
    """``ranges`` sorted, with overlapping and touching ranges joined and empty ones dropped.

    Raises:
        ValueError: a range ends before it starts, or starts below 0.
    """
    out: list[Range] = []
    for start, end in sorted(ranges):
        if start < 0 or end < start:
            raise ValueError(f"not a byte range: [{start}, {end})")
        if start == end:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def added(held: Iterable[Range], new: Range) -> list[Range]:
    """``held`` with ``new`` in it."""
    return merged([*held, new])


def covers(held: Iterable[Range], wanted: Range) -> bool:
    """Whether every byte of ``wanted`` is in ``held`` (an empty ``wanted`` always is)."""
    start, end = wanted
    if start >= end:
        return True
    return any(a <= start and end <= b for a, b in merged(held))


def missing(wanted: Iterable[Range], held: Iterable[Range]) -> list[Range]:
    """The bytes of ``wanted`` not in ``held``, merged."""
    have = merged(held)
    out: list[Range] = []
    for start, end in merged(wanted):
        for a, b in have:
            if b <= start or a >= end:
                continue
            if a > start:
                out.append((start, a))
            start = max(start, b)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def total(ranges: Iterable[Range]) -> int:
    """Bytes in ``ranges`` (overlaps counted once)."""
    return sum(end - start for start, end in merged(ranges))
