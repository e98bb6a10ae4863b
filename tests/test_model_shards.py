"""Shard-level properties of the decoder and its weight loading (no reference model).

- splitting the layers over pipeline shards does not change the logits;
- a shard reads only its own tensors;
- batched decode equals decoding each sequence alone; chunked prefill equals one chunk;
- a GGUF file written the way llama.cpp's converter writes it (q/k permuted for llama)
  loads to the same model as the safetensors checkpoint;
- malformed inputs raise the documented errors.
"""

from __future__ import annotations

import json
import os

import pytest
import tiny_models as tm
import torch
from safetensors.torch import load_file, save_file

from shardline.models.config import ModelConfig, UnsupportedModelError
from shardline.models.shard_loader import load_shard
from shardline.models.weights import WeightFormatError, open_weights

LAYERS = 4
THETA = 500_000.0


def _tokens(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tm.VOCAB, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(HF model, safetensors directory) of a tiny 4-layer untied Llama."""
    model = tm.hf_model("llama", num_layers=LAYERS, rope_theta=THETA, seed=3)
    directory = tm.save_hf(model, tmp_path_factory.mktemp("llama"), legacy_rope_keys=True)
    return model, directory


def _whole(directory) -> torch.nn.Module:
    source = open_weights(directory)
    return load_shard(source, 0, source.config.num_layers, dtype=torch.float32)


# --- pipeline ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("bounds", [(0, 2, 4), (0, 1, 3, 4)], ids=["2-shards", "3-shards"])
def test_pipeline_shards_match_one_shard(tmp_path, arch, bounds):
    model = tm.hf_model(arch, num_layers=LAYERS, rope_theta=THETA, tie=arch == "qwen3", seed=4)
    tm.save_hf(model, tmp_path, legacy_rope_keys=True)
    one = _whole(tmp_path)
    shards = [load_shard(open_weights(tmp_path), a, b, dtype=torch.float32) for a, b in zip(bounds, bounds[1:])]
    assert [s.is_first for s in shards] == [True] + [False] * (len(shards) - 1)
    assert [s.is_last for s in shards] == [False] * (len(shards) - 1) + [True]
    assert all(s.lm_head is None and s.norm is None for s in shards[:-1])
    assert all(s.embed is None for s in shards[1:])

    prompt = _tokens(5, 10)
    one_cache = tm.new_cache(one)
    caches = [tm.new_cache(s) for s in shards]

    def prefill_batch(shard):
        return shard.prefill_batch(0, 0, len(prompt), True)

    expected = one(torch.tensor(prompt), prefill_batch(one), one_cache)
    got = tm.run_pipeline(shards, caches, torch.tensor(prompt), prefill_batch)
    diffs = [(got - expected).abs().max().item()]
    for step in range(4):
        token = int(torch.argmax(expected[0]))
        pos = len(prompt) + step

        def decode_batch(shard, pos=pos):
            return shard.decode_batch([0], [pos])

        expected = one(torch.tensor([token]), decode_batch(one), one_cache)
        got = tm.run_pipeline(shards, caches, torch.tensor([token]), decode_batch)
        diffs.append((got - expected).abs().max().item())
    print(f"\npipeline {arch} {bounds}: max|diff| {max(diffs):.2e}")
    assert max(diffs) <= 1e-6, diffs


# --- what a shard reads ---------------------------------------------------------------


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if name.startswith("model.layers."):
        return int(parts[2])
    if name.startswith("blk."):
        return int(parts[1])
    return None


@pytest.mark.timeout(30)
def test_safetensors_shard_reads_only_its_tensors(llama):
    _, directory = llama
    file_bytes = os.path.getsize(directory / "model.safetensors")
    all_names = open_weights(directory).names()

    source = open_weights(directory)
    load_shard(source, 1, 3, dtype=torch.float32)
    read = set(source.tensors_read)
    assert len(read) == len(source.tensors_read), "a tensor was read twice"
    assert read == {n for n in all_names if _layer_of(n) in (1, 2)}
    assert source.bytes_read == 4 * sum(load_file(directory / "model.safetensors")[n].numel() for n in read)
    assert source.bytes_read < file_bytes / 2

    first = open_weights(directory)
    load_shard(first, 0, 2, dtype=torch.float32)
    read = set(first.tensors_read)
    assert "model.embed_tokens.weight" in read
    assert "model.norm.weight" not in read and "lm_head.weight" not in read
    assert {_layer_of(n) for n in read} == {None, 0, 1}
    assert first.bytes_read < file_bytes

    last = open_weights(directory)
    load_shard(last, 2, 4, dtype=torch.float32)
    read = set(last.tensors_read)
    assert {"model.norm.weight", "lm_head.weight"} <= read
    assert "model.embed_tokens.weight" not in read
    assert {_layer_of(n) for n in read} == {None, 2, 3}


@pytest.mark.timeout(30)
def test_tied_last_shard_reads_embedding_as_head(tmp_path):
    model = tm.hf_model("qwen3", num_layers=LAYERS, tie=True, seed=6)
    tm.save_hf(model, tmp_path, legacy_rope_keys=True)
    source = open_weights(tmp_path)
    assert "lm_head.weight" not in source.names()
    shard = load_shard(source, 2, 4, dtype=torch.float32)
    assert "model.embed_tokens.weight" in source.tensors_read
    assert shard.embed is None
    torch.testing.assert_close(shard.lm_head.dequantized(), model.model.embed_tokens.weight.detach(), rtol=0, atol=0)


@pytest.mark.timeout(30)
def test_gguf_shard_reads_only_its_tensors(llama, tmp_path):
    model, _ = llama
    path = tm.write_gguf(model, tmp_path / "tiny.gguf", arch="llama", rope_theta=THETA)
    source = open_weights(path)
    load_shard(source, 1, 3, dtype=torch.float32)
    assert {_layer_of(n) for n in source.tensors_read} == {1, 2}
    assert set(source.tensors_read) == {n for n in source.names() if _layer_of(n) in (1, 2)}
    assert source.bytes_read < os.path.getsize(path) / 2


# --- batching and chunking ------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_decode_matches_single_decode(tmp_path, arch):
    model = tm.hf_model(arch, num_layers=3, rope_theta=THETA, seed=7)
    tm.save_hf(model, tmp_path, legacy_rope_keys=True)
    shard = _whole(tmp_path)
    prompts = {2: _tokens(8, 5), 0: _tokens(9, 9)}  # slot -> prompt; slot 1 stays unused
    feeds = {slot: _tokens(10 + slot, 4) for slot in prompts}

    batched = tm.new_cache(shard, slots=3)
    alone = {slot: tm.new_cache(shard, slots=3) for slot in prompts}
    for slot, prompt in prompts.items():
        tm.prefill(shard, batched, prompt, slot=slot)
        tm.prefill(shard, alone[slot], prompt, slot=slot)

    slots = list(prompts)
    worst = 0.0
    for step in range(4):
        positions = [len(prompts[s]) + step for s in slots]
        tokens = [feeds[s][step] for s in slots]
        together = tm.decode(shard, batched, tokens, slots, positions)
        for row, slot in enumerate(slots):
            single = tm.decode(shard, alone[slot], [tokens[row]], [slot], [positions[row]])[0]
            diff = (together[row] - single).abs().max().item()
            worst = max(worst, diff)
        slots.reverse()  # the batch order must not matter either
    print(f"\nbatched decode {arch}: max|diff| {worst:.2e}")
    assert worst < 1e-5, worst

    # The batched cache ends up holding what each sequence alone holds.
    for slot, prompt in prompts.items():
        n = len(prompt) + 4
        for layer in range(3):
            torch.testing.assert_close(batched.k[layer][slot, :, :n], alone[slot].k[layer][slot, :, :n])
            torch.testing.assert_close(batched.v[layer][slot, :, :n], alone[slot].v[layer][slot, :, :n])
    assert batched.k[0][1].abs().max() == 0  # the unused slot was never written


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunks", [(7, 6), (5, 4, 4), (12, 1)])
def test_chunked_prefill_matches_one_chunk(llama, chunks):
    _, directory = llama
    shard = _whole(directory)
    prompt = _tokens(11, sum(chunks))
    whole_cache = tm.new_cache(shard)
    expected = tm.prefill(shard, whole_cache, prompt)

    chunk_cache = tm.new_cache(shard)
    start = 0
    for size in chunks:
        got = tm.prefill(shard, chunk_cache, prompt[start : start + size], start=start)
        start += size
    diff = (got - expected).abs().max().item()
    print(f"\nchunked prefill {chunks}: max|diff| {diff:.2e}")
    assert diff < 1e-5
    # The next decode step sees the same cache.
    token = int(torch.argmax(expected))
    a = tm.decode(shard, whole_cache, [token], [0], [len(prompt)])
    b = tm.decode(shard, chunk_cache, [token], [0], [len(prompt)])
    assert (a - b).abs().max().item() < 1e-5


# --- GGUF -------------------------------------------------------------------------------

GGUF_CASES = [
    pytest.param("llama", None, False, id="llama-permuted"),
    pytest.param("qwen2", None, False, id="qwen2-bias"),
    pytest.param("qwen3", None, True, id="qwen3-qknorm-tied"),
    pytest.param("llama", tm.LLAMA3_SCALING, False, id="llama3-rope-freqs"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("arch,scaling,tie", GGUF_CASES)
def test_gguf_matches_safetensors(tmp_path, arch, scaling, tie):
    model = tm.hf_model(arch, num_layers=3, rope_theta=THETA, rope_scaling=scaling, tie=tie, seed=12)
    hf_dir = tm.save_hf(model, tmp_path / "hf", legacy_rope_keys=True)
    factors = tm.llama3_rope_factors(tm.HEAD_DIM, THETA, scaling) if scaling else None
    path = tm.write_gguf(model, tmp_path / "tiny.gguf", arch=arch, rope_theta=THETA, rope_factors=factors)

    st_source, gguf_source = open_weights(hf_dir), open_weights(path)
    a, b = st_source.config, gguf_source.config
    for field in (
        "architecture",
        "num_layers",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "attention_bias",
        "qk_norm",
    ):
        assert getattr(a, field) == pytest.approx(getattr(b, field)), field

    st = load_shard(st_source, 0, 3, dtype=torch.float32)
    gg = load_shard(gguf_source, 0, 3, dtype=torch.float32)
    for name, tensor in st.state_dict().items():
        torch.testing.assert_close(gg.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(gg.inv_freq, st.inv_freq, rtol=1e-6, atol=0)

    prompt = _tokens(13, 20)
    tokens_st, logits_st = tm.greedy(st, prompt, 4)
    tokens_gg, logits_gg = tm.greedy(gg, prompt, 4)
    assert tokens_st == tokens_gg
    diff = (torch.stack(logits_st) - torch.stack(logits_gg)).abs().max().item()
    print(f"\ngguf vs safetensors {arch}: max|diff| {diff:.2e}")
    # float32 rounding apart: a prompt's rows are a matrix-vector product each (rows
    # apart, models.linear.rows_apart_product), whose sums follow each file's weight
    # alignment (1.8e-5 seen)
    assert diff < 5e-5, diff
    # And against the reference implementation itself.
    reference = tm.hf_logits(model, prompt)[-1]
    assert (logits_gg[0] - reference).abs().max().item() < 1e-4


@pytest.mark.timeout(30)
def test_gguf_permutation_is_undone(llama, tmp_path):
    """Loading the GGUF without un-permuting would change the model: the check has teeth."""
    model, directory = llama
    path = tm.write_gguf(model, tmp_path / "tiny.gguf", arch="llama", rope_theta=THETA)
    st = _whole(directory)
    gg = _whole(path)
    q = model.model.layers[0].self_attn.q_proj.weight.detach()
    stored = torch.from_numpy(open_weights(path).read("blk.0.attn_q.weight").numpy().copy())
    assert not torch.equal(stored, q)  # the file really holds the permuted rows
    torch.testing.assert_close(stored, torch.from_numpy(tm.llama_cpp_permute(q.numpy(), tm.HEADS)))
    torch.testing.assert_close(gg.layers[0].attn.qkv.dequantized()[: q.shape[0]], q, rtol=0, atol=0)
    torch.testing.assert_close(st.layers[0].attn.qkv.dequantized(), gg.layers[0].attn.qkv.dequantized())


@pytest.mark.timeout(30)
def test_gguf_q8_0_tensors(llama, tmp_path):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    model, directory = llama
    quantized = ("token_embd.weight", "blk.0.attn_q.weight", "blk.1.attn_k.weight", "blk.2.ffn_down.weight")
    path = tm.write_gguf(model, tmp_path / "q8.gguf", arch="llama", rope_theta=THETA, q8_0=quantized)
    source = open_weights(path)
    types = {t.name: t.tensor_type for t in source.reader.tensors}
    assert all(types[n] == GGMLQuantizationType.Q8_0 for n in quantized)
    gg = load_shard(source, 0, LAYERS, dtype=torch.float32)

    def q8(t: torch.Tensor) -> torch.Tensor:
        array = t.detach().float().numpy()
        qtype = GGMLQuantizationType.Q8_0
        return torch.from_numpy(dequantize(quantize(array, qtype), qtype).reshape(array.shape))

    layers = model.model.layers
    # Q8_0 blocks run along rows, so the row permutation commutes with quantization.
    torch.testing.assert_close(
        gg.layers[0].attn.qkv.dequantized()[:64], q8(layers[0].self_attn.q_proj.weight), rtol=0, atol=0
    )
    torch.testing.assert_close(
        gg.layers[1].attn.qkv.dequantized()[64:96], q8(layers[1].self_attn.k_proj.weight), rtol=0, atol=0
    )
    torch.testing.assert_close(gg.layers[2].mlp.down.dequantized(), q8(layers[2].mlp.down_proj.weight), rtol=0, atol=0)
    torch.testing.assert_close(
        gg.embed.weight.dequantize(torch.float32), q8(model.model.embed_tokens.weight), rtol=0, atol=0
    )

    st = _whole(directory)
    prompt = _tokens(14, 12)
    a = tm.prefill(st, tm.new_cache(st), prompt)
    b = tm.prefill(gg, tm.new_cache(gg), prompt)
    diff = (a - b).abs().max().item()
    print(f"\nq8_0 vs f32: max|diff| {diff:.2e} (logit scale {a.abs().max().item():.1f})")
    assert diff < 0.05 * a.abs().max().item()


# --- errors -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_open_weights_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_weights(tmp_path / "no-such-model")


@pytest.mark.timeout(30)
def test_open_weights_rejects_directory_without_config(tmp_path):
    with pytest.raises(WeightFormatError):
        open_weights(tmp_path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(WeightFormatError):
        open_weights(other)


@pytest.mark.timeout(30)
def test_missing_layer_tensor_is_named(llama, tmp_path):
    _, directory = llama
    state = load_file(directory / "model.safetensors")
    missing = "model.layers.2.mlp.up_proj.weight"
    del state[missing]
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())

    with pytest.raises(WeightFormatError, match=missing.replace(".", r"\.")):
        load_shard(open_weights(tmp_path), 0, LAYERS, dtype=torch.float32)
    with pytest.raises(WeightFormatError, match=r"model\.layers\.2\.mlp\.up_proj"):
        load_shard(open_weights(tmp_path), 2, 3, dtype=torch.float32)
    # Shards that do not hold layer 2 never need it.
    load_shard(open_weights(tmp_path), 0, 2, dtype=torch.float32)
    load_shard(open_weights(tmp_path), 3, LAYERS, dtype=torch.float32)


@pytest.mark.timeout(30)
def test_misshapen_tensor_is_rejected(llama, tmp_path):
    _, directory = llama
    state = load_file(directory / "model.safetensors")
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, tm.HIDDEN)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(WeightFormatError, match="layer 1 k"):
        load_shard(open_weights(tmp_path), 1, 2, dtype=torch.float32)


@pytest.mark.timeout(30)
def test_unsupported_architectures(llama):
    _, directory = llama
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_config(cfg)
    with pytest.raises(UnsupportedModelError):
        ModelConfig.from_gguf_metadata({"general.architecture": "gpt2"}, set())
    with pytest.raises(UnsupportedModelError):
        ModelConfig.from_hf_config(
            {**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_key_value_heads": 3}
        )


def test_a_copied_gguf_finds_the_metadata_its_original_cached(tmp_path, monkeypatch):
    """The cache is keyed by content: a peer's copy (another inode, another path) opens
    without parsing the key/value section again (the parse's transient memory would land
    in the runner that loads it)."""
    import shutil

    from shardline.models import gguf_header
    from shardline.models.weights import GGUFSource

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tm.write_gguf(tm.hf_model("qwen2", seed=6), tmp_path / "a.gguf", arch="qwen2", rope_theta=THETA)
    first = GGUFSource(path)
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    shutil.copy(path, copy)

    def parse(reader):
        raise AssertionError("the copy's metadata was parsed again")

    monkeypatch.setattr(gguf_header, "gguf_metadata", parse)
    again = GGUFSource(copy)
    assert again.metadata == first.metadata and again.config == first.config


def test_a_reopened_gguf_reads_the_same_from_its_cached_header(tmp_path, monkeypatch):
    from shardline.models.gguf_header import header_cache_file
    from shardline.models.weights import GGUFSource

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tm.hf_model("qwen2", seed=5)
    path = tm.write_gguf(model, tmp_path / "q8.gguf", arch="qwen2", rope_theta=THETA, q8_0=("blk.1.ffn_down.weight",))
    first = GGUFSource(path)
    assert header_cache_file(path).is_file()
    second = GGUFSource(path)
    assert second.metadata == first.metadata and second.config == first.config
    assert second.names() == first.names()
    for name in first.names():
        assert torch.equal(second.read(name), first.read(name)), name


@pytest.mark.parametrize("copy_bytes", [None, 64, 1 << 10])
def test_in_memory_fields_read_as_the_library_does(monkeypatch, copy_bytes):
    """The faster metadata parse gives the library's fields and tensor infos, also where
    the key/value section runs past the in-memory copy (then parsed from the map)."""
    from gguf import GGUFReader

    from shardline.models import gguf_header
    from shardline.models.store import default_model_path

    if copy_bytes is not None:
        monkeypatch.setattr(gguf_header, "HEADER_FINGERPRINT_BYTES", copy_bytes)
    path = str(default_model_path())
    fast, plain = gguf_header.in_memory_fields_reader()(path), GGUFReader(path)
    assert list(fast.fields) == list(plain.fields)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "general.architecture", "llama.block_count"):
        assert fast.fields[key].contents() == plain.fields[key].contents(), key
    assert [(t.name, t.data_offset, list(t.shape)) for t in fast.tensors] == [
        (t.name, t.data_offset, list(t.shape)) for t in plain.tensors
    ]
