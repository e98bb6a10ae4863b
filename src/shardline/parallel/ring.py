"""Ring attention: sequence-parallel prefill with the whole model on every rank.

Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
Context" (2023). A prefill chunk of ``length`` tokens is split across the ``world`` ranks
of a ring instance. In every layer each rank computes q, k and v for its own tokens; the
k/v blocks then travel around the ring (rank r sends to r+1 and receives from r-1, in
``world - 1`` hops) while each rank attends its queries to the block it holds and folds
the result into a running output with the numerically stable online-softmax merge
(running log-sum-exp, as in Milakov & Gimelshein, 2018, and FlashAttention, Dao et al.,
2022). The transfer of the next block is posted before the current one is computed, so
the two overlap.

Causal balance: the chunk is cut into ``2 * world`` blocks and rank r takes blocks r and
``2 * world - 1 - r`` (the zig-zag split of Brandon et al., "Striped Attention", 2023, and
of Megatron-LM's context parallelism), so every rank has about the same number of
unmasked query/key pairs.

Every block that passes a rank is also written into that rank's KV cache, so once a layer
has gone round the ring every rank holds the chunk's whole KV cache and decode runs on any
rank without gathering anything.

Where the compiled prefill attention runs (:func:`shardline.models.prefill_attention.takes`:
a bfloat16 cache on a CPU with AVX-512 BF16), a rank attends its rows once every block
has passed, each row over the cache's keys up to its own position: a row's bits are then
its query's and keys' alone, whatever the ring's split, so a prompt resumed from a cached
prefix (whose new rows may run whole on every rank) gives the cold prefill's tokens, and
a ring instance one node's. The blocks' attention and merge above, which round by the
split (a 2-node ring of SmolLM2 in bfloat16 gave 3 of 14 conversations' next turns
another greedy text with the cache than without), run elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardline.models import prefill_attention
from shardline.models.config import Sharding
from shardline.models.kv_cache import KVCache
from shardline.models.llama import DecoderShard, ForwardBatch
from shardline.parallel.progress import Progress
from shardline.parallel.stage import Stage


def block_bounds(length: int, world: int) -> list[tuple[int, int]]:
    """The ``2 * world`` blocks ``(start, end)`` of a chunk, sizes differing by at most 1."""
    blocks = 2 * world
    cuts = [length * i // blocks for i in range(blocks + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(blocks)]


def zigzag_offsets(length: int, world: int, rank: int) -> torch.Tensor:
    """Offsets within the chunk (int64 ``[n]``, ascending) of the tokens rank ``rank`` holds:
    blocks ``rank`` and ``2 * world - 1 - rank`` of :func:`block_bounds`."""
    bounds = block_bounds(length, world)
    (a0, a1), (b0, b1) = bounds[rank], bounds[2 * world - 1 - rank]
    return torch.cat((torch.arange(a0, a1), torch.arange(b0, b1)))


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a block of queries to a block of keys, with its log-sum-exp.

    Args:
        q: ``[n, H, d]``; k, v: ``[m, KVH, d]`` with H a multiple of KVH (grouped-query
            attention: query head h reads key head ``h // (H // KVH)``).
        causal: the blocks cover the same positions (n == m) and query i sees keys 0..i;
            otherwise every key precedes every query and all are seen.

    Returns:
        ``out`` float32 ``[n, H, d]`` and ``lse`` float32 ``[n, H]``, the log-sum-exp of
        each query's scaled scores (torch's fused CPU/CUDA flash-attention kernel, which
        returns it), computed in q's dtype.
    """
    n, heads, d = q.shape
    group = heads // k.shape[1]
    # In the compute dtype, like one node's attention. Computing the blocks in float32 did
    # not make bfloat16 ring instances agree with one node more often (it rounds where one
    # node's bfloat16 kernel does not) and cost 2.5x the time.
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
    kh = k.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
    vh = v.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, causal)
    return out.squeeze(0).transpose(0, 1).float(), lse.squeeze(0).transpose(0, 1).float()


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union.

    ``out`` float32 ``[n, H, d]``, ``lse`` float32 ``[n, H]`` as from :func:`attend_block`.
    With ``lse = log(sum(exp(scores)))`` for each part, the union's lse is
    ``logaddexp(lse_a, lse_b)`` and its output the parts weighted by ``exp(lse_x - lse)``.
    A part that saw no key (lse -inf) gets weight 0; if neither did, the result is
    ``(0, -inf)``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse


class RingContext:
    """One ring prefill chunk as this rank sees it, shared by every layer of the pass.

    Args:
        group: the instance's process group (ranks ``0 .. world-1`` in ring order).
        rank, world: this rank and the ring size.
        slot: the sequence's KV-cache slot; start: the chunk's first position; length:
            the chunk's tokens (all ranks together).
        device: where the k/v blocks live.
        wire_device: where they travel between ranks (None: ``device``; the CPU for gloo
            between ranks on one GPU, which sends no CUDA tensors).

    Raises (from :meth:`attend`): RuntimeError when a transfer fails or times out.
    """

    def __init__(
        self,
        group,
        rank: int,
        world: int,
        slot: int,
        start: int,
        length: int,
        device: torch.device,
        wire_device: torch.device | None = None,
    ) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.wire_device = wire_device or device
        self.slot, self.start, self.length = slot, start, length
        bounds = block_bounds(length, world)
        # Each rank's two blocks (start, end), offsets within the chunk, in position order.
        self.blocks = [(bounds[r], bounds[2 * world - 1 - r]) for r in range(world)]
        self.positions = [start + zigzag_offsets(length, world, r).to(device) for r in range(world)]
        self.on_hop: Callable[[int], None] | None = None  # called after each hop (the progress watchdog)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """Attention of this rank's queries to the cache prefix and the whole chunk.

        q ``[n, H, d]``, k and v ``[n, KVH, d]`` for this rank's tokens (RoPE applied);
        ``k_cache``/``v_cache`` ``[slots, KVH, context, d]`` of this layer: positions
        before ``start`` are read, the chunk's k/v of every rank are written. Returns
        ``[n, H * d]`` in q's dtype.
        """
        n, heads, d = q.shape
        mine = self.blocks[self.rank]  # this rank's two blocks: (start, end) within the chunk
        splits = [hi - lo for lo, hi in mine]
        q_parts = q.split(splits)
        acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        exact = prefill_attention.takes(q, k_cache)  # each row over the cache once all blocks passed
        attending = () if exact else mine  # the blocks whose queries attend each passing block

        def add(i: int, part: tuple[torch.Tensor, torch.Tensor]) -> None:
            held = acc[i]
            acc[i] = part if held is None else merge(*held, *part)

        if self.start > 0 and not exact:
            k_prefix = k_cache[self.slot, :, : self.start].transpose(0, 1)
            v_prefix = v_cache[self.slot, :, : self.start].transpose(0, 1)
            for i in range(2):
                add(i, attend_block(q_parts[i], k_prefix, v_prefix, causal=False))
        block = torch.stack((k, v)).contiguous()  # [2, n, KVH, d]
        sent = block.to(self.wire_device)  # the block as it travels (itself on one device)
        source = self.rank
        for hop in range(self.world):
            pending = []
            if hop < self.world - 1:
                src = (self.rank - 1) % self.world
                incoming = torch.empty(
                    (2, self.positions[(source - 1) % self.world].shape[0], *block.shape[2:]),
                    dtype=block.dtype,
                    device=self.wire_device,
                )
                ops = [
                    dist.P2POp(dist.isend, sent, (self.rank + 1) % self.world, self.group),
                    dist.P2POp(dist.irecv, incoming, src, self.group),
                ]
                pending = dist.batch_isend_irecv(ops)
            k_pos = self.positions[source]
            k_cache[self.slot, :, k_pos] = block[0].transpose(0, 1)
            v_cache[self.slot, :, k_pos] = block[1].transpose(0, 1)
            theirs = self.blocks[source]
            k_parts = block[0].split([hi - lo for lo, hi in theirs])
            v_parts = block[1].split([hi - lo for lo, hi in theirs])
            for i, q_block in enumerate(attending):
                for j, k_block in enumerate(theirs):
                    if k_block[0] >= q_block[1] or k_block[0] == k_block[1] or q_block[0] == q_block[1]:
                        continue  # keys after the queries (or an empty block): nothing seen
                    add(i, attend_block(q_parts[i], k_parts[j], v_parts[j], causal=k_block == q_block))
            for work in pending:
                work.wait()
            if pending:
                sent, block = incoming, incoming.to(k.device)
                source = (source - 1) % self.world
            if self.on_hop is not None:
                self.on_hop(hop)
        if exact:
            rows = [
                prefill_attention.attend(part, k_cache, v_cache, self.slot, self.start + lo)
                for part, (lo, hi) in zip(q_parts, mine)
                if hi > lo
            ]
            return torch.cat(rows).reshape(n, heads * d)
        # Every query sees at least itself, so both of this rank's blocks have a result.
        out = torch.cat([part[0] for part in acc if part is not None])
        return out.to(q.dtype).reshape(n, heads * d)


class RingStage(Stage):
    """This rank of a ring instance: the whole model, prompts split across the ranks.

    A prefill chunk of at least ``min_tokens_per_rank * world_size`` tokens is prefilled
    as a ring (each rank computes its zig-zag share, attention goes round the ring); a
    shorter one, and every decode step, runs whole on every rank with no communication
    (the KV caches are identical, so every rank computes the same). Rank 0 holds the last
    position of every ring chunk (the zig-zag gives it the last block), so it samples.
    :meth:`Stage.run <shardline.parallel.stage.Stage.run>` runs the micro-batches, a ring
    chunk on this rank's share of its token ids (:meth:`local_tokens`). See
    :class:`~shardline.parallel.stage.Stage` for the arguments.
    """

    def __init__(
        self,
        shard: DecoderShard,
        cache: KVCache,
        rank: int,
        world_size: int,
        group=None,
        progress: Progress | None = None,
        min_tokens_per_rank: int = 128,
        wire_device: torch.device | None = None,
    ) -> None:
        super().__init__(
            shard, cache, rank, world_size, Sharding.RING.sampling_rank(world_size), group=group, progress=progress
        )
        self.min_tokens_per_rank = min_tokens_per_rank
        self.wire_device = wire_device  # see RingContext

    def prefill_batch(
        self, slot: int, start: int, length: int, want_logits: bool, every_row: bool = False, key_span: int = 0
    ) -> ForwardBatch:
        """A ring chunk when long enough (rows: this rank's zig-zag share, logits of the
        chunk's last position on rank 0), else, or for the logits of ``every_row`` (a
        prompt's log-probabilities), the whole chunk on every rank (``key_span``:
        :func:`~shardline.parallel.stage.span_keys`; a ring chunk reads its own keys)."""
        if self.world_size == 1 or every_row or length < self.min_tokens_per_rank * self.world_size:
            return super().prefill_batch(slot, start, length, want_logits, every_row, key_span)
        ring = RingContext(
            self.group, self.rank, self.world_size, slot, start, length, self.shard.device, self.wire_device
        )
        positions = ring.positions[self.rank]
        cos, sin = self.shard.rope(positions)
        last = [positions.shape[0] - 1] if want_logits and self.samples else []
        ring.on_hop = lambda hop: self.progress.mark(f"ring hop {hop + 1} of {self.world_size}")
        return ForwardBatch(
            prefill=True,
            slot=slot,
            start=start,
            slots=torch.tensor([slot]),
            positions=positions,
            cos=cos,
            sin=sin,
            attn_mask=None,
            kv_len=start + length,
            rows=[],
            logit_rows=torch.tensor(last, dtype=torch.long, device=self.shard.device),
            ring=ring,
        )

    def prefill_rows_apart(self) -> bool:
        """Not on a ring of several ranks: a ring chunk's rows attend round the ring, in
        shares its length decides."""
        return self.world_size == 1 and super().prefill_rows_apart()

    def decode_batch(self, slots: list[int], positions: list[int]) -> ForwardBatch:
        """A decode step, on every rank alike; only the sampling rank computes logits."""
        batch = self.shard.decode_batch(slots, positions)
        if not self.samples:
            batch.logit_rows = batch.logit_rows[:0]
        return batch

    def local_tokens(self, tokens: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """A ring chunk's token ids at this rank's zig-zag positions (int64 ``[n]``, the
        rows of ``batch``); every token id of any other batch."""
        ring = batch.ring
        if ring is None:
            return tokens
        assert isinstance(ring, RingContext)  # a ring stage's batches carry its own
        return tokens[ring.positions[self.rank].cpu() - batch.start]
