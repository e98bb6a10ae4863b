"""Prefix caching: a finished sequence's slot keeps the keys and values of its prompt, and
a later prompt that starts with the same tokens takes that slot and prefills only the
rest (vLLM's automatic prefix caching, Kwon et al. 2023, keyed the same way, but by slot:
a slot's positions are one view of the KV cache, :class:`~shardline.models.kv_cache.KVCache`).

- A finished (or cancelled) sequence's slot becomes a *cached prefix*: the rows of its
  prompt whose keys and values have the bits a cold prefill of them gives
  (:attr:`Sequence.exact_end <shardline.runner.engine.Sequence>`; its generated tokens
  and a short last chunk are left out: see below), with their token ids and a hash
  chained over each whole block (:func:`~shardline.runner.block_hashes.block_hashes`).
  Its pages past them go back to the system; the pages it keeps (its last one possibly
  part full) count in the KV pool (:attr:`CachedPrefix.tokens`), so caching adds no
  memory beyond the pool placement counted.
- While nothing runs or waits, a cached prefix grows over the rest of its sequence (its
  generated tokens, which a conversation's next turn re-sends), a chunk a step, computed
  as a cold prefill computes them (:func:`plan_extension`): the next turn prefills only
  its new tokens.
- A waiting task takes the cached slot whose tokens match the longest run of its prompt
  (:func:`matched_tokens`: whole blocks by their hashes, then token by token; a block
  part full or shared in part is shared too, SGLang's radix cache shares single tokens),
  resumes where :func:`reuse` says, prefills from there, and reports those tokens as
  cached.
  Nothing is copied: the slot's keys are already where its attention reads them. Where
  the slot holds at least a chunk more than the task shares with it (another
  conversation that shares its system prompt), the task instead copies the shared
  positions into a slot of its own, if it gets one and its blocks without evicting that
  prefix, so the other conversation's next turn still finds its own.
- Cached slots are evicted least recently used when a task needs a slot or pool tokens
  (:func:`plan_admission`); a running sequence's slot never is. Every task that starts
  without the cache also starts with it, at the same step: the cached tokens are
  evictable, so the pool and the slots are what they would be without them.

Everything here is a pure function of state every rank of an instance holds alike (the
agreed tasks, the agreed sampled tokens, the order sequences finished in), so each rank
reuses and evicts the same slots at the same step with no message of its own.

Exact: the keys, values and logits of a prompt row depend on the row's token, the keys
before it, how many keys its chunk's attention reads and how many rows the chunk has,
not on where the chunk starts. With prefix caching on, every chunk reads the keys up to
the next multiple of the chunk, those past each row masked
(:func:`~shardline.parallel.stage.span_keys`), as a whole chunk does. A chunk of more
than :data:`~shardline.models.llama.FUSED_PREFILL_MAX_ROWS` rows takes the torch layers,
whose products give each row the same bits whatever the chunk's size; a shorter one takes
the fused decode layers, and products of fewer than
:data:`~shardline.models.native_dequant.AMX_PREFILL_MIN_ROWS` rows another product
(:func:`row_class`). So every prefill piece is computed as the chunk a cold prefill,
cut at multiples of the chunk, computes its rows in (:func:`window_rows`;
:func:`~shardline.models.weight_products.computed_as`): a hit resumes where its match
ends, however few rows are left in that chunk, and only rows computed in a whole chunk's
class are cached (:func:`exact_end`): a hit then gives a cold prefill's bits, and the
same tokens, greedy or seeded. (SmolLM2-135M Q4_1 in bfloat16, 20 prompts of 416-1,674
tokens resumed from a cached 224-1,440: 0 of 20 texts (16 greedy tokens) differed;
without the key span 2 did, the rows of a cached prefix's short last chunk having read
fewer keys. Resuming an agent's 50-token turn after 6,000 cached tokens, computed as its
chunk rather than started 96 rows back to reach that chunk's class: SmolLM2 126 -> 62-70
ms, a 1.5B Q4_K_M model 497 -> 274 ms, 2 vCPUs.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardline.models.kv_cache import whole_blocks
from shardline.models.llama import FUSED_PREFILL_MAX_ROWS
from shardline.models.native_dequant import AMX_PREFILL_MIN_ROWS
from shardline.runner.block_hashes import block_hashes


def row_class(rows: int) -> int:
    """Which computation a prefill chunk of ``rows`` rows takes, as far as a row's bits go:
    0 the fused decode layers (at most :data:`FUSED_PREFILL_MAX_ROWS`), 1 the int8 product
    (below :data:`AMX_PREFILL_MIN_ROWS`), 2 the AMX or dense product. Constants, not what
    this machine runs, so every rank classes a chunk alike."""
    return (rows > FUSED_PREFILL_MAX_ROWS) + (rows >= AMX_PREFILL_MIN_ROWS)


def matched_tokens(prompt: tuple[int, ...], prompt_hashes: list[int], cached: "CachedPrefix", block: int) -> int:
    """Tokens that start both ``prompt`` and the cached prefix: the longest run of whole
    blocks whose hashes match (their token ids compared too: a hash collision matches
    nothing), then token by token into the next block. The task takes the slot in place or
    copies positions, so a block need not be whole to be shared."""
    n = 0
    for mine, theirs in zip(prompt_hashes, cached.hashes):
        if mine != theirs:
            break
        n += 1
    tokens = n * block
    if prompt[:tokens] != cached.token_ids[:tokens]:
        return 0
    end = min(len(prompt), len(cached.token_ids), tokens + block)
    while tokens < end and prompt[tokens] == cached.token_ids[tokens]:
        tokens += 1
    return tokens


def window_rows(start: int, total: int, chunk: int) -> int:
    """Rows of the chunk a cold prefill of a ``total``-token prompt computes position
    ``start`` in (cut at multiples of ``chunk``, its last chunk possibly short): what a
    prefill piece starting there is computed as (:func:`row_class`), so each of its rows
    gets a cold prefill's bits."""
    a = start // chunk * chunk
    return min(a + chunk, total) - a


def exact_end(end: int, start: int, length: int, chunk: int, computed_as: int) -> int:
    """A sequence's prefix of cacheable rows after a prefill piece ``start .. start +
    length - 1`` computed as a chunk of ``computed_as`` rows: rows ``0 .. end - 1`` had
    the bits a cold prefill of whole chunks gives them; the piece extends that where it
    follows on and was computed in a whole chunk's :func:`row_class`."""
    if start == end and row_class(computed_as) == row_class(chunk):
        return start + length
    return end


def reuse(matched: int, total: int, chunk: int) -> int:
    """Where a prompt of ``total`` tokens whose first ``matched`` tokens are cached resumes
    its prefill so that it gives a cold prefill's bits (0: it prefills all).

    Short of the last token (its logits are computed). A cached row was computed in a
    whole chunk's class (:func:`exact_end`), so none may stand for a row of a cold last
    chunk of another class (a short one): the prompt then resumes at that chunk's start.
    Elsewhere it resumes at ``matched``, its first piece computed as the cold chunk it
    lies in (:func:`window_rows`), however few rows it has."""
    start = min(matched, total - 1)
    last = (total - 1) // chunk * chunk  # the cold prefill's last chunk starts there
    if row_class(total - last) != row_class(chunk):
        start = min(start, last)
    return max(start, 0)


@dataclass(frozen=True)
class CachedPrefix:
    """A free slot's cached prompt: keys and values of ``token_ids`` at positions ``0 ..
    len - 1`` (its last block possibly part full); ``hashes``: its whole blocks'
    (:func:`~shardline.runner.block_hashes.block_hashes`); ``used``: when it was last
    cached or taken (a counter every rank advances alike), for least-recently-used
    eviction; ``rest``: the tokens that followed them in its sequence (the prompt's rows
    computed in another class, the generated tokens), not cached yet
    (:func:`plan_extension`); ``block``: the KV block, tokens."""

    slot: int
    token_ids: tuple[int, ...]
    hashes: tuple[int, ...]
    used: int
    rest: tuple[int, ...] = ()
    block: int = field(kw_only=True)

    @property
    def tokens(self) -> int:
        """KV-pool tokens its pages hold: its tokens rounded up to whole blocks."""
        return whole_blocks(len(self.token_ids), self.block)

    def extended(self, end: int) -> "CachedPrefix":
        """It holding its first ``end`` tokens (of ``token_ids + rest``) once an
        :class:`Extension` computed them."""
        tokens = self.token_ids + self.rest
        return replace(
            self, token_ids=tokens[:end], hashes=tuple(block_hashes(tokens[:end], self.block)), rest=tokens[end:]
        )


@dataclass(frozen=True)
class Extension:
    """A cached prefix's slot ``slot`` grows over its sequence's tokens ``start .. start +
    length - 1``, computed as whole chunks (:func:`row_class`)."""

    slot: int
    start: int
    length: int


EXTENSION_ROWS = 128
"""Most rows a cached prefix grows by in a step: a task that arrives while it grows
waits for at most these (a 1.5B Q4_K_M model on 2 vCPUs, a 100-token prompt sent right
after another conversation's 420-token answer: 729-749 ms to its first token, against
1,558-1,587 ms behind the answer's whole 512-row chunk)."""


def plan_extension(cached: list[CachedPrefix], free_tokens: int, chunk: int, block: int) -> Extension | None:
    """The rows that make a cached prefix cover more of its sequence while the engine
    idles (nothing runs or waits), or None.

    A conversation's next prompt holds this one's answer: generated rows have decode's
    bits, not a cold prefill's, so they are not cached when the sequence ends, and the next
    turn would prefill them before its new tokens. Computed here while nothing else runs,
    as a cold prefill would (cut at multiples of ``chunk``, each piece reading its
    window's keys, computed as a whole chunk), they are cached exactly. The most recently
    used prefix first; at most :data:`EXTENSION_ROWS`, to the end of its chunk window (or
    of its next block, where a block is longer) or of its sequence (a block part full);
    only pool tokens that are free, nothing evicted."""
    for prefix in sorted(cached, key=lambda c: -c.used):
        keep = len(prefix.token_ids)
        a = keep // chunk * chunk
        end = min(keep + len(prefix.rest), max(a + chunk, (keep // block + 1) * block), keep + EXTENSION_ROWS)
        if end > keep and whole_blocks(end, block) - prefix.tokens <= free_tokens:
            return Extension(prefix.slot, keep, end - keep)
    return None


@dataclass(frozen=True)
class Waiting:
    """A waiting task as admission sees it: its prompt (with :func:`block_hashes`), the
    pool tokens it reserves (``need``) and whether it may resume from a cached prefix
    (not when every prompt row's logits are asked for)."""

    prompt: tuple[int, ...]
    hashes: list[int]
    need: int
    may_reuse: bool = True


@dataclass(frozen=True)
class Start:
    """A task admitted: its index among the waiting, its slot, the prompt tokens it takes
    from a cached prefix (0: none), the pool tokens that prefix held (its pages) when it
    takes the prefix's own slot, and ``source``: the cached slot whose first ``reused`` positions it
    copies into its own (None: none, or its slot is the prefix's)."""

    index: int
    slot: int
    reused: int
    held: int = 0
    source: int | None = None


@dataclass(frozen=True)
class Admission:
    """What :func:`plan_admission` decides: the tasks that start and the cached slots
    evicted (in eviction order) to make room; ``evicted_before[i]``: how many of them go
    before start ``i`` (a start may copy from a prefix a later one evicts: the copy reads
    it first)."""

    starts: tuple[Start, ...]
    evicted: tuple[int, ...]
    evicted_before: tuple[int, ...] = ()


def _furthest(task: Waiting, pool: list[CachedPrefix], chunk: int, block: int) -> tuple[CachedPrefix | None, int]:
    """The cached prefix of ``pool`` (least recently used first) from which ``task``
    resumes furthest (:func:`reuse`; the most recently used of equals) and where it
    resumes; (None, 0) where none gives it a token."""
    best: CachedPrefix | None = None
    best_reuse = 0
    if task.may_reuse:
        for prefix in reversed(pool):  # most recently used first: it wins ties
            r = reuse(matched_tokens(task.prompt, task.hashes, prefix, block), len(task.prompt), chunk)
            if r > best_reuse:
                best, best_reuse = prefix, r
    return best, best_reuse


def plan_admission(
    waiting: list[Waiting],
    free_slots: list[int],
    cached: list[CachedPrefix],
    free_tokens: int,
    chunk: int,
    block: int,
    room: int | None = None,
) -> Admission:
    """Which waiting tasks start, in order, and where (first come, first served: the first
    that cannot start and every task behind it wait).

    Args:
        waiting: the waiting tasks, in admission order.
        free_slots: slots free and holding nothing, ascending.
        cached: free slots holding a cached prefix.
        free_tokens: pool tokens neither reserved by a running sequence nor held by a
            cached prefix.
        chunk, block: the prefill chunk and the KV block, tokens.
        room: most tasks that may start (the batch's places no running sequence holds,
            where the KV cache has more slots than the batch:
            :func:`~shardline.models.kv_cache.cache_slots`); None: as many as the slots
            take.

    A task takes the cached slot from which it resumes furthest (:func:`reuse`; the most
    recently used of equals), whose tokens count toward its reservation; else an empty
    slot, the lowest; else the least recently used cached slot, evicted. Then, while the
    pool lacks its reservation, the least recently used other cached slots are evicted. A
    task that would not fit with every cached slot evicted waits, and nothing is evicted
    for it: it would not have fit without the cache either.

    Where that cached slot holds at least ``chunk`` tokens past those the task resumes
    after, or more past them than before them (the task shares little of it: a chat
    template's header, a short system prompt, and another conversation follows), the
    task copies them into a slot of its own instead (``Start.source``), if it gets one
    (an empty slot, or the least recently used other cached one, evicted), and its
    reservation, without evicting the prefix it copies (which counts as used now); else
    it takes the slot as above.
    """
    free = _Free(sorted(free_slots), sorted(cached, key=lambda c: c.used), free_tokens)
    starts: list[Start] = []
    before: list[int] = []  # evictions made before each start
    for index, task in enumerate(waiting):
        if room is not None and len(starts) >= room:
            break  # the batch is full
        best, best_reuse = _furthest(task, free.pool, chunk, block)
        others = sum(c.tokens for c in free.pool if c is not best)
        past = len(best.token_ids) - best_reuse if best is not None else 0
        if (
            best is not None
            and (past >= chunk or past > best_reuse)
            and (free.slots or len(free.pool) > 1)
            and task.need <= free.tokens + others
        ):  # a copy of its shared part
            slot = free.slot(best)
            free.reserve(task.need, best)
            free.pool.remove(best)
            free.pool.append(best)  # used now: the most recent
            starts.append(Start(index, slot, best_reuse, source=best.slot))
        else:
            held = best.tokens if best is not None else 0
            if best is None and not free.slots and not free.pool:
                break  # no slot
            if task.need > free.tokens + held + others:
                break  # it would not fit without the cache either
            if best is not None:  # its slot, and the tokens it held
                slot = best.slot
                free.pool.remove(best)
                free.tokens += held
            else:
                slot = free.slot(None)
            free.reserve(task.need, None)
            starts.append(Start(index, slot, best_reuse, held))
        before.append(len(free.evicted))
    return Admission(tuple(starts), tuple(free.evicted), tuple(before))


@dataclass
class _Free:
    """What :func:`plan_admission` may give the tasks it starts: the empty ``slots``
    (ascending), the cached prefixes in ``pool`` (least recently used first), the pool's
    free ``tokens``, and the cached slots ``evicted`` so far (in order)."""

    slots: list[int]
    pool: list[CachedPrefix]
    tokens: int
    evicted: list[int] = field(default_factory=list)

    def evict(self, keep: CachedPrefix | None) -> int:
        """Evict the least recently used cached slot but ``keep``; its slot."""
        victim = next(c for c in self.pool if c is not keep)
        self.pool.remove(victim)
        self.evicted.append(victim.slot)
        self.tokens += victim.tokens
        return victim.slot

    def slot(self, keep: CachedPrefix | None) -> int:
        """The lowest empty slot, else the least recently used cached one but ``keep``'s."""
        return self.slots.pop(0) if self.slots else self.evict(keep)

    def reserve(self, need: int, keep: CachedPrefix | None) -> None:
        """Take ``need`` pool tokens, evicting cached slots but ``keep``'s while short."""
        while self.tokens < need:
            self.evict(keep)
        self.tokens -= need
