"""Linear weights held once, in the file's own quantization, and the kernels that read them.

A weight is one of four resident forms (:data:`ResidentWeight`), chosen at load from what
the file stores, never by quantizing again:

- :class:`DenseWeight`: 16-bit (or float32) values, for F16/BF16/F32 tensors
  (safetensors models, GGUF norms); ``F.linear``.
- :class:`~shardline.models.packed_groups.PackedGroups`: the 5- and 6-bit types (Q5_0,
  Q5_1, Q5_K, Q6_K) in about their file's bits, read by the compiled kernels.
- :class:`Int4Planes`: other GGUF types with one scale per 32 weights (Q4_0, Q4_1, Q4_K,
  Q8_0). A 4-bit type is one plane in torch's CPU int4 layout
  (``torch._weight_int4pack_mm_for_cpu``: ``w = (p - 8) * scale + zero``, per group of 32
  inputs, the layout torchao and gpt-fast use); an 8-bit type is two planes, its
  low and high nibbles (``q = 16 * high + low``), whose products add up. Each plane's
  zero is an exact power-of-two multiple of its scale for the symmetric types, so only
  the rounding of each scale (and a Q4_1/K-type minimum) to the compute dtype differs
  from the file's values.
- :class:`Int8Groups`: the rest (shapes torch's int4 kernel does not take, float32
  instances, CUDA): one byte a weight plus a float32 scale and offset per
  group, dequantized into reused scratch for each product.

On CPU the int4 planes are read at about half a byte per weight by a decode product for
the few rows of a decode step (SmolLM2's 30 layers of one-row GEMMs: int4 4.4 ms against
int8 11.5 ms on the development machine): the compiled
:class:`~shardline.models.native_dequant.Int4Gemv` where it builds (AVX-512 VNNI and
VBMI), which rounds each row's activations to int8 groups and unpacks each weight group
once for every row of the step, else torch's int4 kernel. Either serves every product of up to :data:`KERNEL_MAX_ROWS`
rows, so a decoding sequence's output does not depend on its batch (each row is computed
by the same operations whatever the batch); the compiled one serves prefill chunks too
where the CPU has no AMX, and chunks of fewer than 96 rows where it has
(:func:`~shardline.models.native_dequant.int8_prefill`; longer ones take its AMX product,
:meth:`~shardline.models.native_dequant.Int4Gemv.prefill`). Larger
products (prefill chunks) otherwise dequantize the weight, a block of rows at a time,
into reused scratch (:data:`DEQUANT_SCRATCH_BYTES`) and run a dense GEMM: with the compiled
kernel of :mod:`shardline.models.native_dequant` where it builds, else with torch ops
(the reference: the kernel's values are the same bit for bit). On CUDA every
quantized form is dequantized per product (the CPU int4 layout is not CUDA's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardline.models import kernel_library, native_dequant
from shardline.models.gguf_quants import GroupQuant
from shardline.models.int4_planes import INT4_GROUP, Int4Planes, pack_int4_planes
from shardline.models.packed_groups import PackedGroups, pack_groups, packs
from shardline.models.weight_products import (
    KERNEL_MAX_ROWS,
    blocked_product,
    gemm_dtype,
    in_dtype,
    native,
    padded_rows,
    product_rows,
    scratch,
)

REFINED_LOGITS = 16
"""Outputs per row of the LM head recomputed in float32 (:attr:`Linear.logits`)."""


def rows_apart_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` ``[rows, in]`` (a decode step's rows, at most
    :data:`KERNEL_MAX_ROWS`) in ``weight``'s dtype, each row's bits its own whatever the
    rows beside it, as the quantized forms' decode kernels give them (a sequence's
    greedy text must not change with its batch, nor with its draft's rows). On the CPU
    torch's BLAS sums in an order that depends on the row count: in 16 bits its one-row
    product (a GEMV) differs from its GEMM, whose 2 to 64 rows agree (SmolLM2's down
    projection in bfloat16, oneDNN on an AMD EPYC with AVX-512 BF16; not checked on a
    CPU with AMX, whose kernels oneDNN may choose by row count), so one row is computed
    as two; in float32 MKL's SGEMM differs between 1, 2-3 and 4 or more rows, so each row
    is its own matrix-vector product (the one-row step unchanged; k rows cost k of them).
    Elsewhere (CUDA) one product."""
    if x.device.type != "cpu" or x.shape[0] == 0:
        return F.linear(x, weight)
    if x.dtype == torch.float32:
        return torch.cat([F.linear(row, weight) for row in x.split(1)]) if x.shape[0] > 1 else F.linear(x, weight)
    if x.shape[0] == 1:
        return F.linear(x.expand(2, -1).contiguous(), weight)[:1]
    return F.linear(x, weight)


@dataclass
class DenseWeight:
    """``weight`` ``[out, in]`` in the compute dtype."""

    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def compiled(self) -> bool:
        """Whether decode's products take the compiled dense product
        (:func:`~shardline.models.native_dequant.dense_gemv`): a contiguous bfloat16
        weight on a CPU where it is built (AVX-512 BF16)."""
        w = self.weight
        return (
            w.dtype == torch.bfloat16
            and w.device.type == "cpu"
            and w.is_contiguous()
            and native_dequant.dense_gemv_built()
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for ``x`` ``[rows, in]`` in the weight's dtype: a decode
        step's rows (up to :data:`KERNEL_MAX_ROWS`) each on its own, by the compiled
        dense product where it takes the weight (:meth:`compiled`; the fused decode
        layers call the same one, so their products are these bits) and the rows are
        bfloat16, else :func:`rows_apart_product`; a prefill product's rows padded
        (:func:`~shardline.models.weight_products.padded_rows`), and where its GEMM runs
        in another dtype (:func:`gemm_dtype`) the weight converted a block of rows at a
        time into scratch."""
        if product_rows(x.shape[0]) <= KERNEL_MAX_ROWS:
            if x.dtype == torch.bfloat16 and self.compiled():
                return native_dequant.dense_gemv(self.weight, x).to(torch.bfloat16)
            return rows_apart_product(x, self.weight.to(x.dtype))
        if gemm_dtype(x.dtype) == x.dtype:  # rows padded as blocked_product pads them
            return F.linear(padded_rows(x, x.dtype), self.weight.to(x.dtype))[: x.shape[0]]

        def columns(start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
            out = scratch("out", end - start, self.weight.shape[1], dtype)
            return out.copy_(self.weight[start:end]).t()

        return blocked_product(x, self.weight.shape[0], columns)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.index_select(0, ids).to(dtype)


@dataclass
class Int8Groups:
    """``q`` uint8 ``[out, in]`` with ``scale`` and ``offset`` ``[out, in // group]``
    in float32: ``w = q * scale + offset``, computed in float32 and rounded once to the
    compute dtype when used."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset))

    def _fill(self, work: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        # In float32 (rounded once afterwards): in bfloat16, ``q * scale`` would round
        # before the offset (often -128 * scale) cancels most of it. Three plain passes
        # beat one mixed-dtype addcmul, which converts its inputs first.
        rows, cols = q.shape
        groups = work.copy_(q).view(rows, cols // self.group, self.group)
        groups.mul_(scale[..., None]).add_(offset[..., None])
        return work

    def _rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = end - start, self.q.shape[1]
        work = scratch("work", rows, cols, torch.float32)
        self._fill(work, self.q[start:end], self.scale[start:end], self.offset[start:end])
        return in_dtype(work, dtype)

    def _columns(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """``W.T``'s columns ``[start, end)`` (a transposed scratch view): the compiled
        kernel where there is one, else :meth:`_rows`."""
        if native(dtype) is None:
            return self._rows(start, end, dtype).t()
        out = scratch("out", end - start, self.q.shape[1], dtype)
        return native_dequant.int8_groups(
            self.q[start:end], self.scale[start:end], self.offset[start:end], self.group, out
        ).t()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._rows(0, self.q.shape[0], dtype).clone()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[rows, in]``: up to :data:`KERNEL_MAX_ROWS` rows (decode)
        a product that reads one byte a weight (the compiled kernel, in float32, each row
        on its own), else the weight dequantized block by block and a dense GEMM."""
        if product_rows(x.shape[0]) <= KERNEL_MAX_ROWS and self.group % 8 == 0 and kernel_library.kernels():
            return native_dequant.int8_groups_gemv(self.q, self.scale, self.offset, self.group, x.float()).to(x.dtype)
        work = 0 if native(x.dtype) else 4  # float32 work
        return blocked_product(x, self.q.shape[0], self._columns, work)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        work = torch.empty(len(ids), self.q.shape[1])
        return self._fill(work, self.q[ids], self.scale[ids], self.offset[ids]).to(dtype)


ResidentWeight = DenseWeight | Int8Groups | Int4Planes | PackedGroups


@dataclass
class RowBlocks:
    """A weight ``[rows, in]`` read from its file a block of rows at a time:
    ``read(start, end)`` returns rows ``[start, end)`` as the file stores them (a
    :class:`GroupQuant` or a float tensor). The loader reads the embedding and LM head,
    the largest tensors, this way, so it never holds one whole in its unpacked form."""

    read: Callable[[int, int], GroupQuant | torch.Tensor]
    shape: tuple[int, int]


PACK_ROWS = 4096
"""Rows converted at a time (a multiple of every int4 block), bounding the loader's
temporaries (unpacked groups, the packing's int32 copies) to this many rows of a tensor."""


def resident_weight(
    source: GroupQuant | torch.Tensor | RowBlocks,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    int4: bool = True,
) -> ResidentWeight:
    """The resident form of one weight ``[out, in]``: a float tensor stays dense in
    ``dtype``; 5- and 6-bit integer groups become :class:`PackedGroups` where
    :func:`~shardline.models.packed_groups.packs` allows; other integer groups become
    :class:`Int4Planes` where ``int4`` allows, the group is 32, the device is the CPU and
    torch's int4 kernel takes the shape (``in`` a multiple of 32, ``out`` of 16), else
    :class:`Int8Groups`. No value changes beyond
    rounding scales to ``dtype``. A weight of more than :data:`PACK_ROWS` rows is
    converted (and, from :class:`RowBlocks`, read) that many rows at a time into one
    resident weight allocated once.
    """
    if isinstance(source, RowBlocks):
        read = source.read
    elif isinstance(source, GroupQuant):
        read = source.rows
    else:
        read = lambda start, end: source[start:end]  # noqa: E731
    rows, cols = source.shape
    first = read(0, min(rows, PACK_ROWS))
    convert: Callable[[GroupQuant | torch.Tensor], ResidentWeight]
    held: ResidentWeight | None = None
    if isinstance(first, torch.Tensor):
        convert = lambda t: DenseWeight(t.to(device=device, dtype=dtype))  # type: ignore[union-attr]  # noqa: E731
    elif packs(first, device, dtype):
        convert = lambda g: pack_groups(g, dtype)  # type: ignore[arg-type]  # noqa: E731
    else:
        assert isinstance(first, GroupQuant)
        convert = lambda g: _int8_groups(g.contiguous(), device)  # type: ignore[union-attr, arg-type]  # noqa: E731
        if (
            int4
            and torch.device(device).type == "cpu"
            and first.group == INT4_GROUP
            and cols % INT4_GROUP == 0
            and rows % 16 == 0
        ):
            try:
                held = pack_int4_planes(first.contiguous(), dtype)
                convert = lambda g: pack_int4_planes(g.contiguous(), dtype)  # type: ignore[union-attr, arg-type]  # noqa: E731
            except RuntimeError:  # a torch build without the CPU int4 kernel for this shape
                pass
    if held is None:
        held = convert(first)
    if rows <= PACK_ROWS:
        return held
    whole = _empty_rows(held, rows)
    _set_rows(whole, 0, held)
    del first, held
    for start in range(PACK_ROWS, rows, PACK_ROWS):
        part = read(start, min(rows, start + PACK_ROWS))
        if isinstance(whole, Int4Planes):  # packed in place: no copy of each block
            pack_int4_planes(part.contiguous(), dtype, into=whole, start=start)  # type: ignore[union-attr, arg-type]
        else:
            _set_rows(whole, start, convert(part))
    return whole


def _int8_groups(g: GroupQuant, device: torch.device | str) -> Int8Groups:
    return Int8Groups(
        torch.from_numpy(g.q).to(device),
        torch.from_numpy(g.scale).to(device),
        torch.from_numpy(g.offset).to(device),
        g.group,
    )


def _empty_rows(like: ResidentWeight, rows: int) -> ResidentWeight:
    """A resident weight of ``like``'s form and columns with ``rows`` rows, unfilled."""

    def grown(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        shape = list(t.shape)
        shape[dim] = rows
        return torch.empty(shape, dtype=t.dtype, device=t.device)

    if isinstance(like, DenseWeight):
        return DenseWeight(grown(like.weight))
    if isinstance(like, Int8Groups):
        return Int8Groups(grown(like.q), grown(like.scale), grown(like.offset), like.group)
    if isinstance(like, PackedGroups):
        return like.empty_rows(rows)
    # torch's packed layout is a run of row blocks along its first dimension
    return Int4Planes(
        [grown(p) for p in like.packed], [grown(sz, 1) for sz in like.scales_zeros], rows, like.in_features
    )


def _set_rows(whole: ResidentWeight, start: int, part: ResidentWeight) -> None:
    """Copy ``part`` (of ``whole``'s form) into ``whole``'s rows from ``start``."""
    end = start + part.shape[0]
    if isinstance(whole, DenseWeight) and isinstance(part, DenseWeight):
        whole.weight[start:end] = part.weight
    elif isinstance(whole, Int8Groups) and isinstance(part, Int8Groups):
        whole.q[start:end], whole.scale[start:end] = part.q, part.scale
        whole.offset[start:end] = part.offset
    elif isinstance(whole, PackedGroups) and isinstance(part, PackedGroups):
        whole.set_rows(start, part)
    elif isinstance(whole, Int4Planes) and isinstance(part, Int4Planes):
        for i, (packed, sz) in enumerate(zip(part.packed, part.scales_zeros)):
            whole.packed[i][start:end] = packed
            whole.scales_zeros[i][:, start:end] = sz
    else:
        raise TypeError(f"row block {type(part).__name__} into {type(whole).__name__}")


class Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` for ``x`` of shape ``[rows, in_features]``, ``W`` held as
    one or more :data:`ResidentWeight` parts stacked along the output rows (a fused q/k/v
    whose v is stored in another GGUF type keeps two parts).

    Attributes:
        parts: the weight's row blocks, top to bottom (set by the loader).
        bias: ``[out_features]`` or None.
        partial: the output is one tensor-parallel rank's partial sum: computed and
            returned in float32, so that the all-reduced sum rounds to the compute dtype
            once, like the one-rank output (rounding each partial first made SmolLM2's
            2-rank logits differ from 1 rank's by up to 1.3 and change greedy tokens).
        logits: the LM head: returns float32, and each row's :data:`REFINED_LOGITS`
            largest outputs are recomputed in float32 from the weight's rows (a 16-bit
            output is a step of 0.125 apart at 25: SmolLM2's first answer token, "The"
            25.33 against "L" 25.24 in float32, tied at 25.5 in bfloat16 and lost).
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, partial: bool = False, logits: bool = False
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.partial = partial
        self.logits = logits
        self.parts: list[ResidentWeight] = []
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def set_parts(self, parts: list[ResidentWeight]) -> None:
        """Hold ``parts`` (their rows add up to ``out_features``).

        Raises:
            ValueError: the parts' shapes do not make ``[out_features, in_features]``.
        """
        rows = sum(p.shape[0] for p in parts)
        if rows != self.out_features or any(p.shape[1] != self.in_features for p in parts):
            raise ValueError(
                f"weight parts {[p.shape for p in parts]} do not make [{self.out_features}, {self.in_features}]"
            )
        self.parts = parts

    def nbytes(self) -> int:
        """Bytes of the resident weight (not the bias)."""
        return sum(p.nbytes() for p in self.parts)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight ``[out_features, in_features]`` in ``dtype`` (for tests and
        checks; the forward pass never builds it)."""
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, in_features]`` in the compute dtype; returns ``[rows,
        out_features]`` in the compute dtype (float32 when ``partial``)."""
        if self.partial:
            x = x.float()
        outs = [p.matmul(x) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.logits:
            y = self._refined(y.float(), x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _refined(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """float32 ``y`` ``[rows, out]`` with each row's :data:`REFINED_LOGITS` largest
        entries recomputed as float32 products of ``x`` and the weight's rows, one
        matrix-vector product a row: the same call whatever the rows beside it, so a row's
        logits are the same bits in any batch (one ``bmm`` over the rows took another
        path for one row than for several: a seeded sample changed with its batch). A
        packed 5/6-bit head on the CPU takes one compiled call for all of it
        (:func:`~shardline.models.native_dequant.packed_groups_refine`: 0.1 ms where the
        ops below took 0.3 of a 49,152-row head's decode step)."""
        if (
            x.dtype == torch.float32
            or not len(y)
            or self.out_features < REFINED_LOGITS
            or any(isinstance(p, Int4Planes) and not p.rows_readable() for p in self.parts)
        ):
            return y
        if (
            len(self.parts) == 1
            and isinstance(self.parts[0], PackedGroups)
            and y.device.type == "cpu"
            and kernel_library.kernels() is not None
        ):  # one compiled call
            return native_dequant.packed_groups_refine(self.parts[0], x.float(), y.contiguous(), REFINED_LOGITS)
        ids = top_ids(y, REFINED_LOGITS)  # [rows, k]
        flat, start = ids.reshape(-1), 0
        if len(self.parts) == 1:  # no shape that depends on the ids: a CUDA graph captures it
            weight = self.parts[0].embed(flat, torch.float32)
        else:
            weight = torch.empty(ids.numel(), self.in_features, device=y.device)
            for part in self.parts:  # each id's row from the part that holds it
                end = start + part.shape[0]
                mine = ((flat >= start) & (flat < end)).nonzero().flatten()
                if len(mine):
                    weight[mine] = part.embed(flat[mine] - start, torch.float32)
                start = end
        rows = weight.view(*ids.shape, -1)
        xf = x.float()
        exact = torch.stack([torch.mv(rows[r], xf[r]) for r in range(len(xf))])
        return y.scatter_(1, ids, exact)


TOP_BLOCK = 64
"""Logits per block of :func:`top_ids`' first pass."""


def top_ids(y: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (int64 ``[rows, k]``, in no set order) of the ``k`` largest entries of
    each row of float32 ``y`` ``[rows, n]``, as ``y.topk(k).indices`` up to the order of
    ties: first the largest entry of each block of :data:`TOP_BLOCK`, then the ``k`` blocks
    with the largest, whose ``k * TOP_BLOCK`` entries hold every one of the row's ``k``
    largest (each of those lies in a block whose largest entry is at least the row's
    k-th largest, and at most ``k`` blocks have one), then the top ``k`` of those. A 49,152-entry
    row's top 16: 0.05 ms against torch.topk's 0.17 ms; 8 rows 0.19 against 0.59 ms
    (2-core Sapphire Rapids VM). A row length that is not a multiple of the block, or
    under ``k`` blocks, takes torch.topk. On the CPU where the kernels are built, one
    compiled pass (:func:`~shardline.models.native_dequant.top_k_rows`) instead: a
    49,152-entry row's top 16 in 0.009 ms against torch.topk's 0.084 (2-vCPU Zen 4 VM;
    the ops above took 0.12 ms right after a decode step's LM head)."""
    rows, n = y.shape
    if y.device.type == "cpu" and y.dtype == torch.float32 and k <= min(64, n) and kernel_library.kernels() is not None:
        return native_dequant.top_k_rows(y, k)
    if n % TOP_BLOCK or n // TOP_BLOCK < k:
        return y.topk(k, dim=-1).indices
    blocks = y.reshape(rows, n // TOP_BLOCK, TOP_BLOCK).amax(-1).topk(k, dim=-1).indices  # [rows, k]
    candidates = (blocks.unsqueeze(-1) * TOP_BLOCK + torch.arange(TOP_BLOCK, device=y.device)).view(rows, -1)
    best = y.gather(1, candidates).topk(k, dim=-1).indices
    return candidates.gather(1, best)


class Embedding(nn.Module):
    """Token embedding over a resident weight ``[vocab, hidden]``: rows are dequantized
    as they are looked up. A tied LM head shares the same weight object."""

    def __init__(self) -> None:
        super().__init__()
        self.weight: ResidentWeight | None = None
        self.dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``ids`` ``[N]`` -> ``[N, hidden]`` in the compute dtype."""
        assert self.weight is not None
        return self.weight.embed(ids, self.dtype)


def weight_bytes(module: nn.Module) -> int:
    """Bytes the module's weights take in memory: parameters and buffers' values (norms,
    biases) plus each resident linear and embedding weight, counted once when shared (a
    tied embedding and LM head)."""
    params = {(p.data_ptr(), p.numel()): p for p in module.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    seen: set[int] = set()
    for layer in module.modules():
        held = (
            layer.parts
            if isinstance(layer, Linear)
            else ([layer.weight] if isinstance(layer, Embedding) and layer.weight is not None else [])
        )
        for part in held:
            if id(part) not in seen:
                seen.add(id(part))
                total += part.nbytes()
    return total
