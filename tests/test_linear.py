"""Resident weights in the file's own quantization: exact values, exact products, batch
independence, and what a shard holds."""

import numpy as np
import pytest
import tiny_models as tm
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tiny_models import random_quant_blocks as random_blocks

from shardline.models.gguf_quants import SUPPORTED_TYPES, unpack_blocks
from shardline.models.int4_planes import Int4Planes, int4pack_layout
from shardline.models.linear import DenseWeight, Linear, resident_weight, top_ids, weight_bytes
from shardline.models.packed_groups import PackedGroups
from shardline.models.shard_loader import load_shard
from shardline.models.weight_products import computed_as, gemm_dtype
from shardline.models.weights import open_weights

pytestmark = pytest.mark.timeout(60)

ROWS, BLOCKS = 64, 2  # 64 output rows, 64 (or 512 for K-types) inputs


def resident(type_name: str, dtype: torch.dtype, seed: int = 0):
    data = random_blocks(type_name, rows=ROWS, blocks=BLOCKS, seed=seed)
    oracle = torch.from_numpy(dequantize(data, GGMLQuantizationType[type_name])).double()
    return resident_weight(unpack_blocks(type_name, data), dtype), oracle


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_resident_weight_holds_the_files_values(type_name):
    """float32 scales: the values are the gguf library's to float32 rounding."""
    held, oracle = resident(type_name, torch.float32)
    expected = PackedGroups if type_name in ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "MXFP4") else Int4Planes
    assert isinstance(held, expected)
    got = held.dequantize(torch.float64)
    assert (got - oracle).abs().max() <= 1e-6 * oracle.abs().max()


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_decode_product_matches_the_files_values(type_name):
    """The kernel's product with the resident weight against float64 with the file's
    values: within 1e-3 relative error (float32 activations)."""
    held, oracle = resident(type_name, torch.float32, seed=1)
    x = torch.randn(3, oracle.shape[1], generator=torch.Generator().manual_seed(2))
    got = held.matmul(x).double()
    reference = x.double() @ oracle.T
    assert ((got - reference).norm() / reference.norm()).item() < 1e-3


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q8_0", "Q6_K"])
def test_bfloat16_differs_only_by_rounding_the_scales(type_name):
    held, oracle = resident(type_name, torch.bfloat16, seed=3)
    got = held.dequantize(torch.float64)
    # bf16 keeps 8 significant bits: each scale (and zero) is off by at most 2**-8 of itself.
    assert ((got - oracle).norm() / oracle.norm()).item() < 2**-8


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q5_1", "Q6_K"])
def test_embedding_rows_are_the_weights_rows(type_name):
    held, oracle = resident(type_name, torch.float32, seed=4)
    if isinstance(held, Int4Planes) and not held.rows_readable():
        pytest.skip("torch's int4 layout on this CPU is not one the row reader knows")
    ids = torch.tensor([5, 0, 63, 5])
    got = held.embed(ids, torch.float32).double()
    assert (got - oracle[ids]).abs().max() <= 1e-6 * oracle.abs().max()


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])  # one int4 plane, two
def test_compiled_row_lookup_is_the_torch_ops_bit_for_bit(type_name):
    """An embedding lookup (and the LM head's refined rows) through the compiled kernel
    gives the bits of the torch ops it replaces, in float32 and rounded to bfloat16."""
    from shardline.models import kernel_library

    if kernel_library.kernels() is None:
        pytest.skip("no C compiler on this machine: the torch ops are the only path")
    data = random_blocks(type_name, rows=256, blocks=4, seed=7)
    held = resident_weight(unpack_blocks(type_name, data), torch.bfloat16)
    if not held.rows_readable():
        pytest.skip("torch's int4 layout on this CPU is not one the row reader knows")
    assert len(held.packed) == (2 if type_name == "Q8_0" else 1)
    few = torch.tensor([255, 0, 64, 7, 7, 130])
    many = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))  # threaded
    for ids in (few, many):
        eager = sum(held._plane_rows(i, ids, torch.float32) for i in range(len(held.packed)))
        assert torch.equal(held.embed(ids, torch.float32), eager)
        assert torch.equal(held.embed(ids, torch.bfloat16), eager.to(torch.bfloat16))
    for bad in (256, -1):  # never read past the planes
        with pytest.raises(IndexError):
            held.embed(torch.tensor([3, bad]), torch.float32)


@pytest.mark.parametrize("shift, add, top", [(0, 0, 16), (0, 0, 256), (4, 0, 256), (4, 8, 32), (4, 6, 64)])
def test_compiled_int4_packing_is_torchs_bit_for_bit(shift, add, top):
    """The load's packing kernel writes the bytes torch's int4 packing makes of the same
    plane values: a 4-bit weight, an 8-bit one's low and high planes (Q8_0), a 5-bit
    high plane re-centred (Q5_1), a 6-bit one's (Q6_K)."""
    from shardline.models import kernel_library, native_dequant

    layout = int4pack_layout()
    if kernel_library.kernels() is None or layout is None:
        pytest.skip("no C compiler or no known int4 layout here: torch packs")
    from shardline.models.int4_planes import _nibble_row_order

    if _nibble_row_order() != "halves":
        pytest.skip("this CPU's int4 layout is not the one the kernel writes")
    gen = torch.Generator().manual_seed(shift * 100 + add + top)
    q = torch.randint(0, top, (3 * layout[0], 96), generator=gen).to(torch.uint8)
    values = ((q >> shift) & 15) + add
    assert int(values.max()) <= 15
    expected = torch._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 1)
    got = native_dequant.int4_pack_halves(q, shift, add, layout[0])
    assert got.shape == expected.shape and torch.equal(got, expected)


def test_int4_layout_is_understood_on_this_machine():
    """x86 CPUs with AVX2 or AVX-512 (every CI and development machine) have one."""
    layout = int4pack_layout()
    assert layout is not None
    block, position = layout
    assert sorted(position.tolist()) == list(range(block))


@pytest.mark.parametrize(
    "type_name, dtype",
    [("Q4_1", torch.bfloat16), ("Q8_0", torch.bfloat16), ("Q6_K", torch.bfloat16), ("Q6_K", torch.float32)],
)
def test_each_row_is_computed_independently_of_the_batch(type_name, dtype):
    held, _ = resident(type_name, dtype, seed=5)
    layer = Linear(held.shape[1], held.shape[0])
    layer.set_parts([held])
    x = torch.randn(8, held.shape[1], dtype=dtype)
    together = layer(x)
    for i in range(8):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])


@pytest.mark.parametrize(
    "type_name, dtype",
    [("Q4_1", torch.bfloat16), ("Q6_K", torch.bfloat16), ("Q6_K", torch.float32), ("BF16", torch.bfloat16)],
)
def test_a_piece_computed_as_its_chunk_gets_the_chunks_rows(type_name, dtype):
    """A prefill piece of any rows, computed as a chunk of 300 (the products' kernels as
    for 300 rows, its rows padded for the GEMM), gives those rows of the 300-row product
    bit for bit: a prefix-cache hit's first piece, however short."""
    if type_name == "BF16":
        held = resident_weight(torch.randn(96, 256).to(torch.bfloat16), dtype)
    else:
        held, _ = resident(type_name, dtype, seed=7)
    layer = Linear(held.shape[1], held.shape[0])
    layer.set_parts([held])
    x = torch.randn(300, held.shape[1], dtype=dtype)
    with torch.inference_mode():
        whole = layer(x)
        with computed_as(300):
            for start, rows in ((0, 1), (3, 9), (10, 23), (40, 65), (13, 287)):
                assert torch.equal(layer(x[start : start + rows]), whole[start : start + rows]), (start, rows)


def test_parts_of_different_types_stack_by_rows():
    q, q_oracle = resident("Q4_K", torch.float32)
    v, v_oracle = resident("Q6_K", torch.float32)
    layer = Linear(q.shape[1], 2 * ROWS)
    layer.set_parts([q, v])
    x = torch.randn(2, q.shape[1])
    reference = x.double() @ torch.cat((q_oracle, v_oracle)).T
    assert ((layer(x).double() - reference).norm() / reference.norm()).item() < 1e-3
    with pytest.raises(ValueError, match="do not make"):
        layer.set_parts([q])


def test_float_weights_stay_dense_and_exact():
    w = torch.randn(32, 16, dtype=torch.bfloat16)
    held = resident_weight(w, torch.bfloat16)
    assert isinstance(held, DenseWeight) and torch.equal(held.weight, w)


def test_weight_bytes_counts_a_shared_weight_once():
    held, _ = resident("Q8_0", torch.bfloat16)
    a, b = Linear(held.shape[1], ROWS), Linear(held.shape[1], ROWS)
    a.set_parts([held])
    b.set_parts([held])
    both = torch.nn.ModuleList([a, b])
    assert weight_bytes(both) == held.nbytes()
    # two int4 planes: half a byte each per weight, plus a bf16 scale and zero per 32
    assert held.nbytes() == 2 * (ROWS * 64 // 2 + ROWS * 2 * 2 * 2)


def test_batched_decode_gives_the_same_greedy_tokens_as_alone(tmp_path):
    model = tm.hf_model("llama", num_layers=3, seed=3)
    tm.save_hf(model, tmp_path)
    shard = load_shard(open_weights(tmp_path), 0, 3, dtype=torch.bfloat16)
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8, 1, 4, 6, 2, 9, 11]]

    def run(which: list[int], steps: int = 6) -> dict[int, list[int]]:
        cache = tm.new_cache(shard, slots=2, context=32)
        last = {i: int(torch.argmax(tm.prefill(shard, cache, prompts[i], slot=i))) for i in which}
        out = {i: [last[i]] for i in which}
        for step in range(steps):
            logits = tm.decode(
                shard, cache, [out[i][-1] for i in which], list(which), [len(prompts[i]) + step for i in which]
            )
            for row, i in enumerate(which):
                out[i].append(int(torch.argmax(logits[row])))
        return out

    together = run([0, 1])
    assert together[0] == run([0])[0]
    assert together[1] == run([1])[1]


def test_the_default_gguf_is_held_in_its_own_bits():
    """SmolLM2's Q4_1 layers are one int4 plane, its Q8_0 tied embedding two, shared by
    the LM head; the shard's weights take about the file's bytes for them."""
    from shardline.models.store import default_model_path

    source = open_weights(default_model_path())
    shard = load_shard(source, 0, 30)
    down = shard.layers[0].mlp.down.parts
    assert len(down) == 1 and isinstance(down[0], Int4Planes) and len(down[0].packed) == 1
    assert shard.lm_head.parts[0] is shard.embed.weight
    assert len(shard.embed.weight.packed) == 2
    file_bytes = source.path.stat().st_size
    assert abs(weight_bytes(shard) - file_bytes) < 0.05 * file_bytes
    # the first row of the embedding is the file's
    data = source._tensors["token_embd.weight"].data[:1]
    row = dequantize(np.ascontiguousarray(data), GGMLQuantizationType.Q8_0)
    got = shard.embed(torch.tensor([0])).float().numpy()
    np.testing.assert_allclose(got, row, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K", "F32"])
def test_a_weight_converted_in_row_blocks_equals_one_converted_whole(monkeypatch, type_name):
    """In blocks of PACK_ROWS rows, from the whole groups or read block by block from the
    file (RowBlocks, the loader's embedding and head): the same resident weight."""
    import shardline.models.linear as linear

    if type_name == "F32":
        groups = torch.randn(256, 64, generator=torch.Generator().manual_seed(7))
    else:
        groups = unpack_blocks(type_name, random_blocks(type_name, rows=256, blocks=2, seed=7))
    whole = resident_weight(groups, torch.bfloat16)
    monkeypatch.setattr(linear, "PACK_ROWS", 64)
    reads = []

    def read(start, end):
        reads.append((start, end))
        return groups[start:end] if type_name == "F32" else groups.rows(start, end)

    for blocked in (
        resident_weight(groups, torch.bfloat16),
        resident_weight(linear.RowBlocks(read, (256, groups.shape[1])), torch.bfloat16),
    ):
        assert type(blocked) is type(whole)
        assert torch.equal(blocked.dequantize(torch.float32), whole.dequantize(torch.float32))
        if isinstance(whole, Int4Planes):
            for a, b in zip(whole.packed + whole.scales_zeros, blocked.packed + blocked.scales_zeros):
                assert torch.equal(a, b)
    assert reads == [(0, 64), (64, 128), (128, 192), (192, 256)]


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q5_K"])
def test_an_lm_heads_largest_logits_are_float32_products(type_name):
    """The LM head's top outputs are recomputed in float32 from the weight's rows: within
    float32 rounding of the exact product of the bfloat16 input, where the 16-bit output
    is off by up to a bfloat16 step."""
    held, _ = resident(type_name, torch.bfloat16, seed=5)
    head = Linear(held.shape[1], held.shape[0], logits=True)
    head.set_parts([held])
    x = torch.randn(2, held.shape[1], generator=torch.Generator().manual_seed(6)) * 4 + 2
    x = x.to(torch.bfloat16)
    exact = x.double() @ held.dequantize(torch.float64).T
    y = head(x)
    assert y.dtype == torch.float32
    top = exact.topk(4, dim=-1).indices
    refined = (y.gather(1, top).double() - exact.gather(1, top)).abs().max().item()
    plain = (held.matmul(x).double().gather(1, top) - exact.gather(1, top)).abs().max().item()
    assert refined < 1e-4 * exact.abs().max().item() < plain
    assert torch.equal(y.argmax(dim=-1), exact.argmax(dim=-1))


def test_an_lm_head_takes_no_rows():
    held, _ = resident("Q4_1", torch.bfloat16)
    head = Linear(held.shape[1], held.shape[0], logits=True)
    head.set_parts([held])
    assert head(torch.empty(0, held.shape[1], dtype=torch.bfloat16)).shape == (0, held.shape[0])


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q5_K", "Q6_K", "MXFP4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_dequant_is_the_eager_code_bit_for_bit(type_name, dtype, monkeypatch):
    """A prefill product's weight block from the compiled kernel (one and two int4 planes,
    int8 groups) equals the eager torch code's, and so does the product (the GEMM's, as
    where the CPU has AMX tiles)."""
    from shardline.models import kernel_library, native_dequant

    monkeypatch.setattr(native_dequant, "int8_prefill", lambda rows: False)

    if kernel_library.kernels() is None:
        pytest.skip("no C compiler on this machine: the eager code is the only path")
    data = random_blocks(type_name, rows=256, blocks=4, seed=5)
    held = resident_weight(unpack_blocks(type_name, data), dtype)
    x = torch.randn(80, held.shape[1], generator=torch.Generator().manual_seed(6)).to(dtype)
    gemm = gemm_dtype(dtype)  # float32 for bfloat16 where this CPU has no bfloat16 GEMM
    if isinstance(held, PackedGroups):
        values = held._eager_rows(dtype)
        assert torch.equal(held.dequantize(dtype), values)
        # the GEMM reads W.T as the kernel writes it, contiguous [in, out]
        product = torch.mm(x.to(gemm), held._eager_rows(gemm).t().contiguous()).to(dtype)
        assert torch.equal(held.matmul(x), product)
        return
    if isinstance(held, Int4Planes) and dtype == torch.bfloat16:  # float32 planes: eager
        assert held._kernel_half(dtype) is not None, "the kernel reads this machine's layout"
    eager = held._rows(64, 192, dtype).clone()
    assert torch.equal(held._columns(64, 192, dtype).t(), eager)
    # The reference GEMM reads the eager values in the layout the kernel writes: a bf16
    # GEMM's summation order may depend on its operand's strides (it does on AVX2).
    columns = held._columns(0, 256, gemm)
    reference = torch.empty_strided(columns.shape, columns.stride(), dtype=gemm)
    reference.copy_(held._rows(0, 256, gemm).t())
    assert torch.equal(held.matmul(x), torch.mm(x.to(gemm), reference).to(dtype))


@pytest.mark.parametrize("type_name", ["Q6_K", "Q5_1", "MXFP4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("aligned", [True, False])
def test_transposed_packed_dequant_is_the_eager_code(type_name, dtype, aligned):
    """A prefill GEMM's operand ``W.T`` from packed groups: three blocks of 16 rows (the
    last one alone, where pairs make whole lines), into aligned memory (written around the
    caches) and not."""
    from shardline.models import kernel_library, native_dequant

    if kernel_library.kernels() is None:
        pytest.skip("no C compiler on this machine: the eager code is the only path")
    held = resident_weight(unpack_blocks(type_name, random_blocks(type_name, rows=48, blocks=1, seed=8)), dtype)
    assert isinstance(held, PackedGroups)
    rows, k = held.shape
    memory = torch.zeros(rows * k + 64, dtype=dtype)
    start = -memory.data_ptr() % 64 // dtype.itemsize + (0 if aligned else 1)
    out = memory[start : start + rows * k].view(k, rows)
    native_dequant.packed_groups_cols(held, out)
    assert torch.equal(out, held._eager_rows(dtype).t())


@pytest.mark.parametrize("type_name, bits", [("Q6_K", 7), ("Q5_K", 6), ("Q5_0", 5.5), ("Q5_1", 6), ("MXFP4", 4.5)])
def test_five_and_six_bit_types_are_held_in_about_their_files_bits(type_name, bits):
    """bfloat16: the integers' bits plus a bfloat16 scale (and offset) per group, against
    the file's 6.56 (Q6_K), 5.5 (Q5_K, Q5_0), 6 (Q5_1) and 4.25 (MXFP4: 4-bit codes)
    bits a weight."""
    held, _ = resident(type_name, torch.bfloat16)
    assert isinstance(held, PackedGroups)
    assert held.nbytes() * 8 / (held.shape[0] * held.shape[1]) == bits


@pytest.mark.parametrize("bits", [4, 5, 6])
def test_compiled_packing_gives_numpys_bytes(monkeypatch, bits):
    """The load's compiled ``pack_groups_bits`` lays out 4-bit codes and 5- and 6-bit
    integers in the same bytes as the numpy code it replaces (every value of each bit
    width, at every place)."""
    import numpy as np

    from shardline.models import kernel_library
    from shardline.models.packed_groups import _packed_bits

    if kernel_library.kernels() is None:
        pytest.skip("no C compiler on this machine: numpy packs")
    q = np.random.default_rng(bits).integers(0, 2**bits, (32, 256), dtype=np.uint8)
    compiled = _packed_bits(q, bits)
    monkeypatch.setattr(kernel_library, "kernels", lambda: None)
    for got, want in zip(compiled, _packed_bits(q, bits)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want)


def test_compiled_scales_and_zeros_round_as_torch_does(monkeypatch):
    """The load's compiled bfloat16 layout of an int4 plane's scales and zeros: the bits
    torch's rounding gives (ties to even, infinities, subnormals; a NaN stays a NaN, whose
    bits torch's own paths do not agree on), in place at a row offset of a larger weight."""
    from shardline.models import kernel_library, native_dequant

    if kernel_library.kernels() is None:
        pytest.skip("no C compiler on this machine: torch lays them out")
    g = torch.Generator().manual_seed(5)
    scale, zero = torch.randn(16, 6, generator=g), torch.randn(16, 6, generator=g) * 1e-3
    special = torch.tensor(
        [1 + 2**-8, 1 + 3 * 2**-8, float("inf"), -float("inf"), 3.4e38, 1e-40, -0.0, 3.0e38]
    )  # two ties, then the edges
    scale.view(-1)[: len(special)] = special
    zero.view(-1)[-len(special) :] = special
    compiled = torch.full((6, 40, 2), 7, dtype=torch.bfloat16)
    native_dequant.scales_zeros_into(scale, zero, compiled, 16)
    monkeypatch.setattr(kernel_library, "kernels", lambda: None)
    eager = torch.full((6, 40, 2), 7, dtype=torch.bfloat16)
    native_dequant.scales_zeros_into(scale, zero, eager, 16)
    assert torch.equal(compiled.view(torch.int16), eager.view(torch.int16))
    assert (eager[:, :16] == 7).all() and (eager[:, 32:] == 7).all()
    monkeypatch.undo()
    native_dequant.scales_zeros_into(torch.full((2, 6), float("nan")), zero[:2], compiled, 0)
    assert compiled[:, :2, 0].isnan().all()


@pytest.mark.parametrize("type_name", ["Q6_K", "MXFP4"])
def test_packed_groups_without_a_compiler_give_the_same_values(monkeypatch, type_name):
    """The eager torch path (no C compiler) dequantizes bit for bit as the kernel does, and
    its products (decode and prefill sizes) agree within float32 rounding."""
    from shardline.models import kernel_library

    if kernel_library.kernels() is None:
        pytest.skip("no C compiler on this machine: the eager code is the only path")
    held, _ = resident(type_name, torch.float32, seed=8)
    x = torch.randn(100, held.shape[1], generator=torch.Generator().manual_seed(9))
    compiled = held.dequantize(torch.bfloat16), held.matmul(x[:3]), held.matmul(x)
    monkeypatch.setattr(kernel_library, "kernels", lambda: None)
    eager = held.dequantize(torch.bfloat16), held.matmul(x[:3]), held.matmul(x)
    assert torch.equal(compiled[0], eager[0])
    for a, b in zip(compiled[1:], eager[1:]):
        assert ((a - b).norm() / b.norm()).item() < 1e-6


def test_a_build_without_avx512_kernels_declares_every_function():
    """The build without tuned flags (the loader's last fallback; what a CPU without
    AVX-512 VNNI and VBMI, such as a Cascade Lake Xeon or an AVX2 AMD, effectively gets)
    defines every function the loader declares: the products it cannot build are stubs
    that say so. It lacked two, and the loader raised AttributeError on such CPUs."""
    import ctypes
    import shutil

    from shardline.models import kernel_library

    if shutil.which(kernel_library._compiler()) is None:
        pytest.skip("no C compiler on this machine")
    lib = ctypes.CDLL(str(kernel_library._build(kernel_library.FLAGS)))
    kernel_library.declare(lib)
    assert not lib.int4_planes_gemv_built() and not lib.decode_layers_built()


def test_unfinished_kernel_builds_older_than_a_build_are_removed(tmp_path):
    """A builder killed between compiling and renaming leaves a ``*.so.tmp``; the next
    build removes such files once no build could still be writing them."""
    import os

    from shardline.models.kernel_library import COMPILE_TIMEOUT_S, remove_stale_builds

    old, fresh, library = tmp_path / "a.so.tmp", tmp_path / "b.so.tmp", tmp_path / "c.so"
    for f in (old, fresh, library):
        f.write_bytes(b"x")
    now = fresh.stat().st_mtime + 1
    os.utime(old, (now - COMPILE_TIMEOUT_S - 5,) * 2)
    os.utime(library, (now - COMPILE_TIMEOUT_S - 5,) * 2)
    assert remove_stale_builds(tmp_path, now) == [old]
    assert not old.exists() and fresh.exists() and library.exists()


@pytest.fixture(params=["compiled", "torch"])
def top_path(request, monkeypatch):
    """:func:`top_ids` through the compiled selection, and through torch ops (where the
    kernels are not built)."""
    from shardline.models import kernel_library

    if request.param == "torch":
        monkeypatch.setattr(kernel_library, "kernels", lambda: None)
    elif kernel_library.kernels() is None:
        pytest.skip("the kernels are not built here")
    return request.param


@pytest.mark.fast
@pytest.mark.parametrize("rows,n,k", [(1, 49152, 16), (8, 4096, 16), (3, 64 * 16, 16), (2, 1000, 16), (2, 256, 16)])
def test_top_ids_are_the_largest_entries(rows, n, k, top_path):
    """The blocked first pass keeps every one of a row's k largest (the clustered rows put
    them all in one block, or one per block; n = 1000 and 4 blocks take torch.topk); the
    compiled pass likewise (the ascending row replaces its best at every entry)."""
    gen = torch.Generator().manual_seed(n)
    y = torch.randn(rows, n, generator=gen)
    y[0, 128 : 128 + k] += 10.0  # all in one block
    if rows > 1:
        y[1, ::64] += 10.0  # one per block
    if rows > 2:
        y[2] = torch.arange(n, dtype=torch.float32)  # ascending
    got = top_ids(y, k)
    want = y.topk(k, dim=-1).indices
    assert got.shape == (rows, k)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


@pytest.mark.fast
def test_compiled_top_ids_pass_over_nan(top_path):
    """A NaN first logit does not stop the compiled pass (its bar stays a number)."""
    if top_path == "torch":
        pytest.skip("torch.topk takes NaN as the largest")
    y = torch.randn(1, 4096, generator=torch.Generator().manual_seed(2))
    y[0, 0] = y[0, 100] = float("nan")
    clean = y.nan_to_num(nan=-float("inf"))
    assert torch.equal(top_ids(y, 16).sort(-1).values, clean.topk(16).indices.sort(-1).values)


@pytest.mark.fast
def test_top_ids_on_ties_keeps_the_top_values(top_path):
    """With more than k equal largest entries, which k is free: their values are the top."""
    y = torch.zeros(2, 4096)
    y[:, ::7] = 1.0  # 586 entries tie for the largest
    got = top_ids(y, 16)
    assert bool((y.gather(1, got) == 1.0).all())
