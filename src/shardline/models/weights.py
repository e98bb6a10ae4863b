"""Reading one shard's weights from GGUF files or Hugging Face safetensors directories.

A rank reads only the tensors of its layer range (and the embedding or head where its
shard holds them). Both formats are memory-mapped, so the bytes of other layers are never
read; :attr:`WeightSource.bytes_read` counts what was.

Formats:
- GGUF: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, read with the ``gguf``
  library, which also dequantizes every block format it knows. llama.cpp's converter
  stores the q and k projections of ``llama`` models permuted for interleaved RoPE; they
  are un-permuted here so one RoPE (rotate-half) serves both formats.
- safetensors: https://huggingface.co/docs/safetensors, read with ``safe_open``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from shardline.models.config import ModelConfig


class WeightFormatError(ValueError):
    """A weight file is missing a tensor, or a tensor has the wrong shape."""


class WeightSource:
    """Named float tensors read on demand; counts the tensors and bytes it has read.

    Subclasses name the file's tensors: ``TOP_NAMES`` (embed, norm, head), and per layer
    ``LAYER_FORMAT`` filled with the layer index and a ``LAYER_NAMES`` entry.
    """

    TOP_NAMES: dict[str, str]
    LAYER_FORMAT: str
    LAYER_NAMES: dict[str, str]
    config: ModelConfig
    rope_freq_factors: torch.Tensor | None = None

    def __init__(self) -> None:
        self.tensors_read: list[str] = []
        self.bytes_read = 0

    def names(self) -> set[str]:
        raise NotImplementedError

    def bits(self, name: str) -> float:
        """Bits a weight of tensor ``name`` takes in the file (block scales included)."""
        raise NotImplementedError

    def _read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as float32 (or its stored float dtype), PyTorch layout.

        Raises:
            WeightFormatError: the file has no tensor of that name.
        """
        if name not in self.names():
            raise WeightFormatError(f"tensor {name!r} is missing from the weights")
        tensor = self._read(name)
        self.tensors_read.append(name)
        return tensor


class GGUFSource(WeightSource):
    """Weights and configuration from one GGUF file (memory-mapped)."""

    TOP_NAMES = {"embed": "token_embd.weight", "norm": "output_norm.weight",
                 "head": "output.weight"}
    LAYER_FORMAT = "blk.{layer}.{name}"
    LAYER_NAMES = {
        "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
        "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
        "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
        "o": "attn_output.weight", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
        "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
    }

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        from gguf import GGUFReader

        self.path = Path(path)
        self.reader = GGUFReader(str(self.path))
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.metadata = gguf_metadata(self.reader)
        self.config = ModelConfig.from_gguf_metadata(self.metadata, set(self._tensors))
        if "rope_freqs.weight" in self._tensors:
            self.rope_freq_factors = self.read("rope_freqs.weight").float()

    def names(self) -> set[str]:
        return set(self._tensors)

    def bits(self, name: str) -> float:
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self._tensors[name].tensor_type]
        return 8 * size / block

    def _read(self, name: str) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self._tensors[name]
        self.bytes_read += int(t.n_bytes)
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.array(t.data, copy=True)
        elif t.tensor_type == GGMLQuantizationType.BF16:
            raw = np.array(t.data, copy=True).view(np.uint16).astype(np.uint32) << 16
            array = raw.view(np.float32)
        else:
            array = dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(array).reshape(shape))


def gguf_metadata(reader) -> dict:
    """GGUF key/value metadata as plain Python values (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - an unreadable optional field is left out
            continue
    return meta


class SafetensorsSource(WeightSource):
    """Weights from a Hugging Face model directory (config.json + *.safetensors)."""

    TOP_NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
                 "head": "lm_head.weight"}
    LAYER_FORMAT = "model.layers.{layer}.{name}"
    LAYER_NAMES = {
        "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
        "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
        "v": "self_attn.v_proj.weight", "q_bias": "self_attn.q_proj.bias",
        "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
        "o": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight", "gate": "mlp.gate_proj.weight",
        "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    }

    def __init__(self, directory: str | Path) -> None:
        super().__init__()
        from safetensors import safe_open

        self.path = Path(directory)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise WeightFormatError(f"{self.path} has no config.json")
        self.config = ModelConfig.from_hf_config(json.loads(config_file.read_text()))
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise WeightFormatError(f"{self.path} has no .safetensors files")
        self._handles = {}
        self._where = {}
        for file in files:
            handle = safe_open(str(file), framework="pt")
            self._handles[file] = handle
            for key in handle.keys():
                self._where[key] = file

    def names(self) -> set[str]:
        return set(self._where)

    def bits(self, name: str) -> float:
        dtype = self._handles[self._where[name]].get_slice(name).get_dtype()
        return {"F32": 32, "F16": 16, "BF16": 16, "F8_E4M3": 8, "F8_E5M2": 8}.get(dtype, 16)

    def _read(self, name: str) -> torch.Tensor:
        tensor = self._handles[self._where[name]].get_tensor(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def open_weights(path: str | Path) -> WeightSource:
    """Open a GGUF file or a safetensors directory.

    Raises:
        WeightFormatError: the path is neither.
        FileNotFoundError: the path does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return GGUFSource(path)
    if path.is_dir() and (path / "config.json").is_file():
        return SafetensorsSource(path)
    raise WeightFormatError(
        f"{path} is neither a .gguf file nor a directory with config.json and safetensors"
    )


def _unpermute_gguf_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half RoPE layout)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    head_dim = rows // heads
    return (
        weight.reshape(heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)
    )


def _names(source: WeightSource, layer: int | None, part: str) -> str:
    """Source tensor name of ``part`` (shardline's name) in global ``layer`` (None: top)."""
    if layer is None:
        return source.TOP_NAMES[part]
    return source.LAYER_FORMAT.format(layer=layer, name=source.LAYER_NAMES[part])


def shard_state_dict(
    source: WeightSource, layer_start: int, layer_end: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The state dict of :class:`~shardline.models.llama.DecoderShard` for a layer range.

    Reads only the tensors of layers ``[layer_start, layer_end)``, plus the embedding when
    ``layer_start == 0`` and the final norm and head (the embedding when tied) when the
    range ends at the last layer. Every tensor is cast to ``dtype``.

    Raises:
        WeightFormatError: a tensor is missing or has an unexpected shape.
    """
    config = source.config
    permuted = isinstance(source, GGUFSource) and config.architecture == "llama"
    out: dict[str, torch.Tensor] = {}

    def get(layer: int | None, part: str) -> torch.Tensor:
        return source.read(_names(source, layer, part))

    def check(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(tensor.shape) != shape:
            raise WeightFormatError(
                f"{name} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        return tensor

    d, hd = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_heads * hd, config.num_kv_heads * hd
    if layer_start == 0:
        out["embed.weight"] = check("embedding", get(None, "embed"), (config.vocab_size, d)).to(dtype)
    for local, layer in enumerate(range(layer_start, layer_end)):
        p = f"layers.{local}."
        q = check(f"layer {layer} q", get(layer, "q"), (q_rows, d))
        k = check(f"layer {layer} k", get(layer, "k"), (kv_rows, d))
        v = check(f"layer {layer} v", get(layer, "v"), (kv_rows, d))
        if permuted:
            q = _unpermute_gguf_rope(q, config.num_heads)
            k = _unpermute_gguf_rope(k, config.num_kv_heads)
        out[p + "attn.qkv.weight"] = torch.cat((q, k, v)).to(dtype)
        if config.attention_bias:
            qb, kb, vb = get(layer, "q_bias"), get(layer, "k_bias"), get(layer, "v_bias")
            if permuted:
                qb = _unpermute_gguf_rope(qb, config.num_heads)
                kb = _unpermute_gguf_rope(kb, config.num_kv_heads)
            out[p + "attn.qkv.bias"] = torch.cat((qb, kb, vb)).to(dtype)
        out[p + "attn.o.weight"] = check(f"layer {layer} o", get(layer, "o"), (d, q_rows)).to(dtype)
        if config.qk_norm:
            out[p + "attn.q_norm.weight"] = get(layer, "q_norm").to(dtype)
            out[p + "attn.k_norm.weight"] = get(layer, "k_norm").to(dtype)
        out[p + "attn_norm.weight"] = get(layer, "attn_norm").to(dtype)
        out[p + "mlp_norm.weight"] = get(layer, "mlp_norm").to(dtype)
        inter = config.intermediate_size
        gate = check(f"layer {layer} gate", get(layer, "gate"), (inter, d))
        up = check(f"layer {layer} up", get(layer, "up"), (inter, d))
        out[p + "mlp.gate_up.weight"] = torch.cat((gate, up)).to(dtype)
        out[p + "mlp.down.weight"] = check(f"layer {layer} down", get(layer, "down"), (d, inter)).to(dtype)
    if layer_end == config.num_layers:
        out["norm.weight"] = get(None, "norm").to(dtype)
        if config.tie_word_embeddings:
            head = out.get("embed.weight")
            if head is None:
                head = get(None, "embed").to(dtype)
        else:
            head = get(None, "head").to(dtype)
        out["lm_head.weight"] = check("LM head", head, (config.vocab_size, d))
    return out


def _linear_sources(source: WeightSource, module: str, layer_start: int) -> list[str]:
    """Source tensor names behind one of DecoderShard's fused linear modules."""
    if module == "lm_head":
        head = "embed" if source.config.tie_word_embeddings else "head"
        return [_names(source, None, head)]
    _, local, block, kind = module.split(".")  # layers.<i>.<attn|mlp>.<qkv|o|gate_up|down>
    parts = {"qkv": ["q", "k", "v"], "o": ["o"], "gate_up": ["gate", "up"], "down": ["down"]}[kind]
    return [_names(source, layer_start + int(local), part) for part in parts]


def load_shard(
    source: WeightSource,
    layer_start: int,
    layer_end: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    decode_rows: int = 0,
):
    """Build a :class:`~shardline.models.llama.DecoderShard` holding only its own weights.

    ``decode_rows`` > 0 (CPU only) adds a quantized copy of every linear weight, used for
    inputs of at most that many rows (decode; see :mod:`shardline.models.linear`): int4
    where the file stores the weight in about 5 bits or fewer (GGUF Q4_0, Q4_1, Q4_K, ...),
    int8 otherwise.

    Raises:
        WeightFormatError: a tensor is missing or misshapen.
    """
    from shardline.models.linear import Linear
    from shardline.models.llama import DecoderShard, rope_inverse_frequencies

    state = shard_state_dict(source, layer_start, layer_end, dtype)
    with torch.device("meta"):
        shard = DecoderShard(source.config, layer_start, layer_end)
    state = {k: v.to(device) for k, v in state.items()}
    missing, unexpected = shard.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise WeightFormatError(
            f"shard weights do not match: missing {missing}, unexpected {unexpected}"
        )
    shard.inv_freq = rope_inverse_frequencies(source.config, source.rope_freq_factors).to(device)
    if decode_rows > 0 and torch.device(device).type == "cpu":
        for name, module in shard.named_modules():
            if isinstance(module, Linear):
                bits = max(source.bits(n) for n in _linear_sources(source, name, layer_start))
                module.add_decode_copy(4 if bits <= 5.25 else 8, decode_rows)
    shard.eval()
    return shard
