"""GGUF blocks unpack to integer groups that give exactly the gguf library's values."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tiny_models import random_quant_blocks as random_blocks

from shardline.models.gguf_quants import SUPPORTED_TYPES, GroupQuant, unpack_blocks

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_unpacked_groups_give_the_gguf_librarys_values(type_name):
    data = random_blocks(type_name, rows=6, blocks=3)
    oracle = dequantize(data, GGMLQuantizationType[type_name])
    unpacked = unpack_blocks(type_name, data)
    assert unpacked.q.max() < 2**unpacked.bits
    got = unpacked.dequantize()
    assert got.shape == oracle.shape
    np.testing.assert_allclose(got, oracle, rtol=1e-6, atol=1e-6 * np.abs(oracle).max())


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q6_K"])
def test_symmetric_types_have_offset_minus_center_times_scale(type_name):
    unpacked = unpack_blocks(type_name, random_blocks(type_name, rows=2, blocks=1))
    np.testing.assert_array_equal(unpacked.offset, -unpacked.symmetric_center * unpacked.scale)


def test_column_and_row_slices_keep_values():
    data = random_blocks("Q4_K", rows=4, blocks=2)
    whole = unpack_blocks("Q4_K", data)
    part = whole.rows(1, 3).cols(64, 256)
    np.testing.assert_array_equal(part.dequantize(), whole.dequantize()[1:3, 64:256])
    with pytest.raises(ValueError, match="cut through groups"):
        whole.cols(16, 64)
    both = GroupQuant.concat([whole.rows(0, 1), whole.rows(3, 4)])
    np.testing.assert_array_equal(both.dequantize(), whole.dequantize()[[0, 3]])


F16_AT = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
"""Byte offsets of each type's f16 scales (and minimums) in its block (ggml-common.h)."""


@pytest.mark.parametrize("type_name", sorted(F16_AT))
def test_compiled_unpacking_gives_the_numpy_unpackers_groups(type_name):
    """The load's one-pass kernel, on random blocks whose f16 scales include subnormals,
    zeros, negative zero and infinities: the same q, scales, offsets and form bit for bit.
    (MXFP4 has no compiled unpacking: numpy unpacks it.)"""
    from shardline.models import kernel_library, native_dequant

    if kernel_library.kernels() is None:
        pytest.skip("no C compiler on this machine: numpy unpacks")
    data = random_blocks(type_name, rows=40, blocks=5, seed=3)
    halves = np.array([0x0001, 0x03FF, 0x0000, 0x8000, 0x7C00, 0xFC00, 0x8123, 0x3C00], np.uint16)
    f16_at = F16_AT[type_name]
    size = data.shape[1] // 5
    for i, h in enumerate(halves):
        row, block = divmod(i, 5)
        for at in f16_at:
            data[row, block * size + at : block * size + at + 2] = np.frombuffer(h.tobytes(), np.uint8)
    with np.errstate(invalid="ignore"):  # an infinite d times a zero scale: NaN, on purpose
        numpy_groups = unpack_blocks(type_name, data)
    compiled = native_dequant.unpack_blocks(type_name, data)
    for field in ("q", "scale", "offset"):
        got, want = getattr(compiled, field), getattr(numpy_groups, field)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=field)
    assert (compiled.bits, compiled.group, compiled.symmetric_center) == (
        numpy_groups.bits,
        numpy_groups.group,
        numpy_groups.symmetric_center,
    )


def test_mxfp4_exponents_from_subnormal_to_large_give_the_librarys_values():
    """E8M0 exponents 0 (2**-128, a float32 subnormal) to 250 (where 28 x the scale, the
    largest q form, still fits a float32: 12 x 2**126 overflows in the library too), and
    every E2M1 code: exact, as 5-bit groups of centre 16 with a power-of-two scale."""
    data = random_blocks("MXFP4", rows=251, blocks=2, seed=5)
    data[:, 0] = data[:, 17] = np.arange(251, dtype=np.uint8)
    oracle = dequantize(data, GGMLQuantizationType.MXFP4)
    unpacked = unpack_blocks("MXFP4", data)
    assert (unpacked.bits, unpacked.group, unpacked.symmetric_center) == (5, 32, 16)
    assert set(np.unique(unpacked.q)) <= {16 + k for k in (0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12)}
    np.testing.assert_array_equal(unpacked.dequantize(), oracle)
