"""The compiled decode products with int8 activations, of int4 planes
(``native_dequant.Int4Gemv``) and of packed 5/6-bit groups
(``native_dequant.packed_groups_gemv`` for bfloat16 weights): against a float64 reference
per shape (of the activations rounded to int8 groups), and each row the same bits whatever
rows run beside it."""

import pytest
import torch
from tiny_models import random_quant_blocks

from shardline.models import native_dequant
from shardline.models.gguf_quants import unpack_blocks
from shardline.models.int4_planes import Int4Planes, pack_int4_planes
from shardline.models.packed_groups import BLOCK_ROWS, PackedGroups, pack_groups

pytestmark = [
    pytest.mark.fast,
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not native_dequant.int4_gemv_built(), reason="the compiled int4 decode product needs AVX-512 VNNI and VBMI"
    ),
]


TYPES = {1: "Q4_1", 2: "Q8_0"}  # planes: a 4-bit type is one, an 8-bit type two
SHAPES = [(64, 32), (128, 96), (192, 576)]  # (out, in)
ROWS = [1, 2, 7, 8, 15, 16, 17, 33, 64, 65, 130]  # beyond 64: tiles of 64 rows


def planes_of(count: int, out: int, k: int, seed: int = 0) -> Int4Planes:
    blocks = random_quant_blocks(TYPES[count], rows=out, blocks=k // 32, seed=seed)
    held = pack_int4_planes(unpack_blocks(TYPES[count], blocks), torch.bfloat16)
    assert len(held.packed) == count
    return held


def product(held: Int4Planes, x: torch.Tensor) -> torch.Tensor:
    return native_dequant.Int4Gemv(list(zip(held.packed, held.scales_zeros)))(x)


def int8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` rounded as the kernel rounds it: per group of 32, ``d = max |x| /
    127`` and ``q = round(x * (127 / max |x|))`` (ties to even), all in float32. Returns
    ``d q`` in float64 and ``d`` ``[M, K / 32]``."""
    v = x.float().view(x.shape[0], -1, 32)
    amax = v.abs().amax(-1, keepdim=True)
    # a tensor divided (a Python number over a tensor is a reciprocal times the number)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(v * inv)
    d = amax / 127.0
    return (q.double() * d.double()).view(x.shape), d.squeeze(-1)


def activations(rows: int, k: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Random ``[rows, k]`` activations with a group of zeros (d = 0) in the first row and
    a group far larger than its neighbours in the last."""
    x = torch.randn(rows, k, generator=gen).to(dtype)
    x[0, :32] = 0
    x[-1, -32:] *= 1000
    return x


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("out, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_product_matches_float64(count, out, k, dtype):
    """The product of the int8-rounded activations with the weights: its integer sums are
    exact, so the error is the output's rounding (bfloat16: 2**-9 relative) and a few
    float32 steps of the sums' scale (4e-6) from scaling them per group; and the rounded
    activations are within half a step of the activations."""
    held = planes_of(count, out, k, seed=out + k)
    weight = held.dequantize(torch.float32).double()  # the held values, exactly
    gen = torch.Generator().manual_seed(count)
    for rows in ROWS:
        x = activations(rows, k, gen, dtype)
        got = product(held, x)
        assert got.dtype == dtype and got.shape == (rows, out)
        rounded, d = int8_groups(x)
        reference = rounded @ weight.T
        error = (got.double() - reference).abs()
        scale = rounded.abs() @ weight.abs().T  # what the sums' rounding scales with
        if dtype == torch.bfloat16:
            assert (error <= 2**-8 * reference.abs() + 4e-6 * scale).all()
        else:
            assert (error <= 4e-6 * scale).all()
        half_step = d.double().repeat_interleave(32, dim=1) / 2
        exact = x.double() @ weight.T
        assert ((got.double() - exact).abs() <= half_step @ weight.abs().T + 2**-8 * exact.abs() + 4e-6 * scale).all()


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_row_is_the_same_bits_whatever_runs_beside_it(count, dtype):
    held = planes_of(count, 192, 576, seed=3)
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(4)).to(dtype)
    alone = torch.cat([product(held, x[i : i + 1]) for i in range(130)])
    for rows in (2, 8, 17, 64, 65, 130):
        assert torch.equal(product(held, x[:rows]), alone[:rows]), rows
    # the same row among other rows (shifted: another tile position)
    assert torch.equal(product(held, x[5:13])[0], alone[5])


def test_decode_takes_the_compiled_product(monkeypatch):
    held = planes_of(2, 128, 96)
    x = torch.randn(3, 96).to(torch.bfloat16)
    assert torch.equal(held.matmul(x), product(held, x))
    chunk = torch.randn(80, 96).to(torch.bfloat16)  # a prefill chunk: where no AMX
    monkeypatch.setattr(native_dequant, "int8_prefill", lambda rows: True)
    assert torch.equal(held.matmul(chunk), product(held, chunk))
    monkeypatch.setattr(native_dequant, "int8_prefill", lambda rows: False)  # the GEMM's
    reference = chunk.double() @ held.dequantize(torch.float32).double().T
    got = held.matmul(chunk)
    assert not torch.equal(got, product(held, chunk))
    assert ((got.double() - reference).norm() / reference.norm()).item() < 1e-2


def test_planes_the_kernel_does_not_take_keep_torchs_kernel():
    """A second plane whose scales are not 16 times the first's cannot share one sum."""
    held = planes_of(2, 64, 32)
    held.scales_zeros[1][..., 0] *= 2
    assert native_dequant.Int4Gemv.refusal(list(zip(held.packed, held.scales_zeros)))
    x = torch.randn(2, 32).to(torch.bfloat16)
    assert held._gemv() is None
    reference = x.double() @ held.dequantize(torch.float32).double().T
    assert ((held.matmul(x).double() - reference).norm() / reference.norm()).item() < 1e-2


def test_bad_input_is_refused():
    held = planes_of(1, 64, 32)
    with pytest.raises(ValueError, match="one or two"):
        native_dequant.Int4Gemv([])
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        product(held, torch.randn(2, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match="float16"):
        product(held, torch.randn(2, 32).to(torch.float16))
    assert product(held, torch.randn(0, 32)).shape == (0, 64)


@pytest.mark.parametrize(
    "rows, amx, takes",
    [
        (65, False, True),
        (4096, False, True),  # no AMX prefill product: every chunk
        (65, True, True),
        (95, True, True),  # AMX: short chunks (the int8 product is faster)
        (96, True, False),
        (512, True, False),  # AMX: Int4Gemv.prefill on the tiles
    ],
)
def test_which_prefill_chunks_take_the_int8_product(rows, amx, takes):
    assert native_dequant.int8_prefill_takes(rows, amx) is takes


amx = pytest.mark.skipif(
    not native_dequant.amx_ready(), reason="the AMX prefill product needs AMX-BF16 tiles (and Linux's leave)"
)


@amx
@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("out, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 17, 96, 130])
def test_amx_prefill_is_the_dequantized_weights_product(count, out, k, rows):
    """The AMX prefill product is x times the bfloat16 weight (dequantized as the GEMM
    path dequantizes it) with float32 sums, rounded once to bfloat16: against float64."""
    held = planes_of(count, out, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(out)).to(torch.bfloat16)
    gemv = native_dequant.Int4Gemv(list(zip(held.packed, held.scales_zeros)))
    reference = x.double() @ held.dequantize(torch.bfloat16).double().T
    got = gemv.prefill(x)
    assert got.shape == (rows, out) and got.dtype == torch.bfloat16
    # float32 sums, then one bfloat16 rounding: within 2^-8 of each value (plus sums' error)
    tolerance = reference.abs() * 2.0**-8 + 1e-5 * reference.abs().max()
    assert ((got.double() - reference).abs() <= tolerance).all()


@amx
def test_prefill_chunks_from_96_rows_take_the_amx_product():
    held = planes_of(2, 128, 96)
    gemv = native_dequant.Int4Gemv(list(zip(held.packed, held.scales_zeros)))
    for rows in (96, 200):
        chunk = torch.randn(rows, 96).to(torch.bfloat16)
        assert torch.equal(held.matmul(chunk), gemv.prefill(chunk))
    chunk = torch.randn(95, 96).to(torch.bfloat16)
    assert torch.equal(held.matmul(chunk), product(held, chunk))  # the int8 product
    with pytest.raises(ValueError, match="bfloat16"):
        gemv.prefill(torch.randn(100, 96))


PACKED = {
    "Q6_K": [(16, 256), (48, 512), (64, 768)],  # groups of 16, 6 bits, symmetric
    "Q5_0": [(16, 32), (48, 96)],  # 32, 5 bits, symmetric
    "Q5_1": [(32, 64)],  # 32, 5 bits, offsets
    "Q5_K": [(16, 256), (32, 512)],  # 32, 5 bits, offsets
    "MXFP4": [(16, 32), (48, 96)],
}  # 32, 4-bit codes of 5-bit integers, symmetric
PACKED_ROWS = [1, 2, 7, 17, 64]


def packed_of(type_name: str, out: int, k: int, seed: int = 0) -> PackedGroups:
    block = 256 if type_name.endswith("_K") else 32
    blocks = random_quant_blocks(type_name, rows=out, blocks=k // block, seed=seed)
    return pack_groups(unpack_blocks(type_name, blocks), torch.bfloat16)


def group_terms(held: PackedGroups) -> torch.Tensor:
    """float64 ``[out, K]``: each weight's ``|offset|`` (``center * scale`` for a symmetric
    type), the size of the offset's share the kernel adds per group."""

    def row_major(t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1).reshape(held.shape[0], -1).double()

    shares = (row_major(held.scale) * held.center if held.offset is None else row_major(held.offset)).abs()
    return shares.repeat_interleave(held.group, dim=1)


@pytest.mark.parametrize("type_name, out, k", [(t, o, k) for t, shapes in PACKED.items() for o, k in shapes])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_product_matches_float64(type_name, out, k, dtype):
    """The int8-rounded activations times the weights: the integer sums are exact, so the
    error is a few float32 steps (4e-6) of what the sums scale with (the weights' values
    and each group's offset share, taken apart), and the rounded activations are within
    half a step of the activations."""
    held = packed_of(type_name, out, k, seed=out + k)
    assert held.shape == (out, k) and held.scale.dtype == torch.bfloat16
    weight = held.dequantize(torch.float32).double()  # the held values, exactly
    gen = torch.Generator().manual_seed(k)
    for rows in PACKED_ROWS:
        x = activations(rows, k, gen, dtype)
        got = native_dequant.packed_groups_gemv(held, x)
        assert got.dtype == torch.float32 and got.shape == (rows, out)
        rounded, d = int8_groups(x)
        reference = rounded @ weight.T
        scale = rounded.abs() @ (weight.abs() + group_terms(held)).T
        assert ((got.double() - reference).abs() <= 4e-6 * scale).all()
        half_step = d.double().repeat_interleave(32, dim=1) / 2
        exact = x.double() @ weight.T
        assert ((got.double() - exact).abs() <= half_step @ weight.abs().T + 4e-6 * scale).all()


@pytest.mark.parametrize("type_name", ["Q6_K", "Q5_1", "MXFP4"])
def test_packed_rows_are_the_same_bits_whatever_runs_beside_them(type_name):
    held = packed_of(type_name, 48, 256, seed=9)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    alone = torch.cat([native_dequant.packed_groups_gemv(held, x[i : i + 1]) for i in range(64)])
    for rows in (2, 8, 17, 64):
        assert torch.equal(native_dequant.packed_groups_gemv(held, x[:rows]), alone[:rows]), rows
    assert torch.equal(held.matmul(x[:3]), alone[:3].to(torch.bfloat16))  # decode takes it


def test_packed_rows_go_in_blocks_of_16():
    """A weight's rows are held in blocks of :data:`BLOCK_ROWS`: row views start and end
    on a block; a 5/6-bit weight of other row counts is held another way (int8 groups)."""
    from shardline.models.linear import Int8Groups, resident_weight

    held = packed_of("Q5_0", 48, 64)
    assert torch.equal(held.rows(16, 48).dequantize(torch.float32), held.dequantize(torch.float32)[16:48])
    with pytest.raises(ValueError, match="multiples of 16"):
        held.rows(8, 48)
    odd = unpack_blocks("Q5_0", random_quant_blocks("Q5_0", rows=BLOCK_ROWS + 8, blocks=2))
    assert isinstance(resident_weight(odd, torch.bfloat16), Int8Groups)


def test_an_lm_heads_refined_logits_are_the_same_bits_whatever_runs_beside_them():
    """The LM head recomputes each row's largest logits in float32; one ``bmm`` over the
    rows took another path for one row than for several (SmolLM2's logits moved by up to
    3e-5 between a batch of 1 and of 2, and a seeded sample with them)."""
    from shardline.models.linear import Linear

    head = Linear(576, 192, logits=True)
    head.set_parts([planes_of(1, 192, 576, seed=5)])
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    alone = torch.cat([head(x[i : i + 1]) for i in range(9)])
    for rows in (2, 3, 8, 9):
        assert torch.equal(head(x[:rows]), alone[:rows]), rows
    assert torch.equal(head(x[4:7])[0], alone[4])


def test_a_packed_lm_heads_refined_logits_are_float32_products_in_any_batch():
    """A 6-bit (Q6_K) head's top logits, recomputed by the compiled refinement: each row's
    16 largest are the float32 products of its activations and the held weight rows (within
    float32 rounding of a 256-term sum), the rest the int8 product's, and a row's logits
    are the same bits whatever runs beside it."""
    from shardline.models.linear import REFINED_LOGITS, Linear

    held = packed_of("Q6_K", 96, 256, seed=3)
    head = Linear(256, 96, logits=True)
    head.set_parts([held])
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    alone = torch.cat([head(x[i : i + 1]) for i in range(9)])
    for rows in (2, 8, 9):
        assert torch.equal(head(x[:rows]), alone[:rows]), rows
    weight = held.dequantize(torch.float32).double()
    exact = x.double() @ weight.T
    coarse = native_dequant.packed_groups_gemv(held, x).to(torch.bfloat16).float()  # the product's logits
    kth = coarse.topk(REFINED_LOGITS, dim=-1).values[:, -1:]
    close = (alone.double() - exact).abs() <= 1e-5 * (x.double().abs() @ weight.abs().T)
    assert close[coarse > kth].all()  # the largest (ties at the k-th: some of them)
    changed = alone != coarse
    assert (changed.sum(-1) <= REFINED_LOGITS).all() and close[changed].all()
