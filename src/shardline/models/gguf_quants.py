"""GGUF quantized blocks unpacked into integer groups, without changing a value.

A GGUF weight row is a run of blocks; each block stores small unsigned integers ``q`` and
the scale (and for some types a minimum) of each group of weights in it. This module
turns a row range of such blocks into one :class:`GroupQuant`: ``q`` per weight, and a
float32 ``scale`` and ``offset`` per group, such that ``w = q * scale + offset`` gives
the value llama.cpp (and the ``gguf`` library's ``dequantize``, the oracle in the tests)
gives for that weight, up to float32 rounding.

Block layouts (ggml's ``ggml-common.h``; the GGUF spec,
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

- Q4_0 (32 weights): f16 d, 16 bytes of nibbles; ``w = d * (q - 8)``.
- Q4_1 (32): f16 d, f16 m, nibbles; ``w = d * q + m``.
- Q5_0 (32): f16 d, 32 high bits, nibbles; ``w = d * (q - 16)``.
- Q5_1 (32): f16 d, f16 m, 32 high bits, nibbles; ``w = d * q + m``.
- Q8_0 (32): f16 d, 32 int8; ``w = d * q``.
- Q4_K (256 = 8 groups of 32): f16 d, f16 dmin, 12 bytes of 6-bit group scales and
  minimums, 128 bytes of nibbles; ``w = d * sc_j * q - dmin * m_j``.
- Q5_K (256 = 8 x 32): as Q4_K plus 32 bytes of high bits.
- Q6_K (256 = 16 groups of 16): 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8
  group scales, f16 d; ``w = d * sc_j * (q - 32)``.
- MXFP4 (32; OCP Microscaling Formats v1.0, as ggml stores it): an E8M0 exponent e, 16
  bytes of 4-bit E2M1 codes; ``w = k * 2**(e - 128)`` where ``k`` is the code's doubled
  E2M1 value (0, 1, 2, 3, 4, 6, 8, 12 and their negatives): an integer of -12..12 with a
  power-of-two scale, held here as ``q = k + 16`` (5 bits), centre 16, whose 15 values
  the codebook (:attr:`GroupForm.codebook`) lists in the file's code order, so that a
  weight can be held as its 4-bit code (:mod:`~shardline.models.packed_groups`).

In the low-nibble byte runs, byte ``i`` of a 32-byte (or 16-byte) run holds weight ``i``
in its low nibble and weight ``i + 32`` (``i + 16``) in its high nibble.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np


class UnsupportedQuantization(ValueError):
    """A GGUF tensor type that has no exact integer-group form here."""


@dataclass
class GroupQuant:
    """Weights as unsigned integers with one scale and offset per group of a row.

    Attributes:
        q: uint8 ``[rows, cols]``, each in ``0 .. 2**bits - 1``.
        scale, offset: float32 ``[rows, cols // group]``; weight ``[r, c]`` is
            ``q[r, c] * scale[r, c // group] + offset[r, c // group]``.
        bits: bits a ``q`` value needs (4, 5, 6 or 8).
        group: weights per scale along a row (16 or 32).
        symmetric_center: for types whose offset is ``-center * scale`` (Q4_0, Q5_0, Q8_0,
            Q6_K), that center (8, 16, 128, 32); None where the offset is free.
        codebook: where ``q`` takes at most 16 values (MXFP4's), those values by 4-bit
            code: ``q`` is ``codebook[code]``; None otherwise.
    """

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    bits: int
    group: int
    symmetric_center: int | None
    codebook: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    @property
    def form(self) -> GroupForm:
        """Its bits, group, centre and codebook: groups of one form stack by rows."""
        return GroupForm(self.bits, self.group, self.symmetric_center, self.codebook)

    def rows(self, start: int, end: int) -> GroupQuant:
        """Rows ``[start, end)``."""
        return replace(self, q=self.q[start:end], scale=self.scale[start:end], offset=self.offset[start:end])

    def cols(self, start: int, end: int) -> GroupQuant:
        """Columns ``[start, end)``; both must fall on group boundaries (or ``end`` at
        the row's end).

        Raises:
            ValueError: a bound cuts through a group.
        """
        g = self.group
        if start % g or (end % g and end != self.q.shape[1]):
            raise ValueError(f"columns [{start}, {end}) cut through groups of {g}")
        return replace(
            self,
            q=self.q[:, start:end],
            scale=self.scale[:, start // g : -(-end // g)],
            offset=self.offset[:, start // g : -(-end // g)],
        )

    def contiguous(self) -> GroupQuant:
        """The same groups in C-contiguous arrays (after slicing)."""
        return replace(
            self,
            q=np.ascontiguousarray(self.q),
            scale=np.ascontiguousarray(self.scale),
            offset=np.ascontiguousarray(self.offset),
        )

    def take_rows(self, index: np.ndarray) -> GroupQuant:
        """Rows in the order of ``index`` (int ``[rows]``)."""
        return replace(self, q=self.q[index], scale=self.scale[index], offset=self.offset[index])

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]``."""
        rows, cols = self.q.shape
        g = self.group
        q = self.q.astype(np.float32).reshape(rows, cols // g, g)
        return (q * self.scale[..., None] + self.offset[..., None]).reshape(rows, cols)

    @staticmethod
    def concat(parts: list[GroupQuant]) -> GroupQuant:
        """Rows of ``parts`` one after another (same columns, bits, group, center and
        codebook).

        Raises:
            ValueError: the parts differ in any of those.
        """
        first = parts[0]
        for p in parts[1:]:
            if (p.q.shape[1], p.form) != (first.q.shape[1], first.form):
                raise ValueError("only groups of one shape and type concatenate")
        return replace(
            first,
            q=np.concatenate([p.q for p in parts]),
            scale=np.concatenate([p.scale for p in parts]),
            offset=np.concatenate([p.offset for p in parts]),
        )


def _f16(raw: np.ndarray) -> np.ndarray:
    """float32 of little-endian f16 stored as 2 uint8 on the last axis."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray, run: int) -> np.ndarray:
    """uint8 values of nibble bytes ``[..., n]``: each run of ``run`` bytes holds weights
    ``0..run-1`` in low nibbles, ``run..2*run-1`` in high ones."""
    shape = raw.shape[:-1]
    r = raw.reshape(*shape, -1, 1, run)
    out = np.concatenate((r & 0x0F, r >> 4), axis=-2)
    return out.reshape(*shape, -1)


def _high_bits(raw: np.ndarray, count: int) -> np.ndarray:
    """Bit ``i`` (little-endian) of ``raw`` ``[..., count // 8]`` for ``i < count``."""
    bits = np.unpackbits(raw, axis=-1, bitorder="little")
    return bits[..., :count]


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes ``[..., 12]`` -> 8 six-bit scales and 8 minimums."""
    a, b, c = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sc = np.concatenate((a & 63, (c & 15) | ((a >> 6) << 4)), axis=-1)
    mn = np.concatenate((b & 63, (c >> 4) | ((b >> 6) << 4)), axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _unpack_q4_0(b):
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 2:18], 16), d, -8 * d


def _unpack_q4_1(b):
    return _nibbles(b[..., 4:20], 16), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _unpack_q5_0(b):
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 6:22], 16) | (_high_bits(b[..., 2:6], 32) << 4)
    return q, d, -16 * d


def _unpack_q5_1(b):
    q = _nibbles(b[..., 8:24], 16) | (_high_bits(b[..., 4:8], 32) << 4)
    return q, _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _unpack_q8_0(b):
    d = _f16(b[..., 0:2])
    q = b[..., 2:34] ^ np.uint8(0x80)  # int8 + 128 as uint8: the sign bit flipped
    return q, d, -128 * d


def _unpack_q4_k(b):
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    return _nibbles(b[..., 16:144], 32), d * sc, -(dmin * mn)


def _unpack_q5_k(b):
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    # qh: bit j of byte l is the high bit of weight l of group j.
    high = np.unpackbits(b[..., 16:48], axis=-1, bitorder="little")  # [..., 32 bytes * 8]
    high = high.reshape(*b.shape[:-1], 32, 8).swapaxes(-1, -2).reshape(*b.shape[:-1], 256)
    q = _nibbles(b[..., 48:176], 32) | (high << 4)
    return q, d * sc, -(dmin * mn)


def _unpack_q6_k(b):
    shape = b.shape[:-1]
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])[..., None]
    # Each half of 128 weights: 64 bytes of ql (low nibbles of weights 0-63, high nibbles
    # of 64-127) and 32 bytes of qh (bits 2i, 2i+1 of byte l: weight l + 32 i's top bits).
    low = _nibbles(ql.reshape(*shape, 2, 64), 64)  # [..., 2, 128]
    top = qh.reshape(*shape, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    top = (top & 3).reshape(*shape, 2, 128)
    q = (low | (top << 4)).reshape(*shape, 256)
    scale = d * sc
    return q, scale, -32 * scale


_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _unpack_mxfp4(b):
    e = b[..., 0].astype(np.int32)
    # 2**(e - 128) as float32 bits (e < 2: the subnormals 2**-128 and 2**-127)
    bits = np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32), (e - 1).astype(np.uint32) << np.uint32(23))
    d = bits.astype(np.uint32).view(np.float32)
    q = (_MXFP4_VALUES[_nibbles(b[..., 1:17], 16)] + 16).astype(np.uint8)
    return q, d, -16 * d


class GroupForm(NamedTuple):
    """The integer-group form a GGUF type unpacks to (see :class:`GroupQuant`)."""

    bits: int
    group: int
    symmetric_center: int | None
    codebook: tuple[int, ...] | None = None


# type name -> (weights per block, bytes per block, group form, unpacker)
_UNPACKERS = {
    "Q4_0": (32, 18, GroupForm(4, 32, 8), _unpack_q4_0),
    "Q4_1": (32, 20, GroupForm(4, 32, None), _unpack_q4_1),
    "Q5_0": (32, 22, GroupForm(5, 32, 16), _unpack_q5_0),
    "Q5_1": (32, 24, GroupForm(5, 32, None), _unpack_q5_1),
    "Q8_0": (32, 34, GroupForm(8, 32, 128), _unpack_q8_0),
    "Q4_K": (256, 144, GroupForm(4, 32, None), _unpack_q4_k),
    "Q5_K": (256, 176, GroupForm(5, 32, None), _unpack_q5_k),
    "Q6_K": (256, 210, GroupForm(6, 16, 32), _unpack_q6_k),
    "MXFP4": (32, 17, GroupForm(5, 32, 16, tuple(int(v) + 16 for v in _MXFP4_VALUES)), _unpack_mxfp4),
}

SUPPORTED_TYPES = tuple(_UNPACKERS)


def block_weights(type_name: str) -> int:
    """Weights per block of a supported type.

    Raises:
        UnsupportedQuantization: the type is not one of :data:`SUPPORTED_TYPES`.
    """
    if type_name not in _UNPACKERS:
        raise UnsupportedQuantization(f"GGUF type {type_name} has no integer-group form")
    return _UNPACKERS[type_name][0]


def block_bytes(type_name: str) -> int:
    """Bytes per block of a supported type.

    Raises:
        UnsupportedQuantization: the type is not one of :data:`SUPPORTED_TYPES`.
    """
    block_weights(type_name)
    return _UNPACKERS[type_name][1]


def group_form(type_name: str) -> GroupForm:
    """The bits, group size and symmetric centre a supported type unpacks to.

    Raises:
        UnsupportedQuantization: the type is not one of :data:`SUPPORTED_TYPES`.
    """
    block_weights(type_name)
    return _UNPACKERS[type_name][2]


UNPACK_ROWS = 4096
"""Rows unpacked at a time into the result, bounding the temporaries to that many rows."""


def unpack_blocks(type_name: str, data: np.ndarray) -> GroupQuant:
    """Unpack uint8 block bytes ``[rows, blocks * block_bytes]`` of GGUF type
    ``type_name`` (e.g. ``"Q4_K"``) into a :class:`GroupQuant` of ``[rows, blocks *
    block_weights]`` weights, :data:`UNPACK_ROWS` rows at a time.

    Raises:
        UnsupportedQuantization: the type is not one of :data:`SUPPORTED_TYPES`.
    """
    block_weights(type_name)
    per_block, size, form, unpack = _UNPACKERS[type_name]
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, size)
    cols = blocks.shape[1] * per_block
    out = GroupQuant(
        np.empty((rows, cols), np.uint8),
        np.empty((rows, cols // form.group), np.float32),
        np.empty((rows, cols // form.group), np.float32),
        *form,
    )
    for start in range(0, rows, UNPACK_ROWS):
        q, scale, offset = unpack(np.ascontiguousarray(blocks[start : start + UNPACK_ROWS]))
        n = q.shape[0]
        out.q[start : start + n] = q.reshape(n, -1)
        out.scale[start : start + n] = np.asarray(scale, np.float32).reshape(n, -1)
        out.offset[start : start + n] = np.asarray(offset, np.float32).reshape(n, -1)
    return out
