"""Reading one shard's weights from GGUF files or Hugging Face safetensors directories.

A rank reads only the tensors of its layer range (and the embedding or head where its
shard holds them). Both formats are memory-mapped, so the bytes of other layers are never
read; :attr:`WeightSource.bytes_read` counts what was.

A tensor-parallel rank (:func:`load_tensor_shard`) reads only its slice of each split
tensor: a range of rows (q/k/v, gate/up: whole heads, MLP columns) or of columns (o, down).
safetensors slices through ``get_slice``; GGUF slices the memory-mapped blocks before
dequantizing (rows always; columns when the range falls on the format's block boundaries,
otherwise a few rows at a time, keeping only the wanted columns), so no rank holds the
whole of a tensor it splits.

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

from shardline.machine_cache import cache_path, write_atomically
from shardline.models.config import ModelConfig, TensorShare

Span = tuple[int, int] | None  # (start, end) along one axis; None: all of it


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

    def _shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _read(self, name: str, rows: Span, cols: Span) -> torch.Tensor:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` in PyTorch layout, without reading it.

        Raises:
            WeightFormatError: the file has no tensor of that name.
        """
        self._check_name(name)
        return self._shape(name)

    def read(self, name: str, rows: Span = None, cols: Span = None) -> torch.Tensor:
        """The tensor ``name`` as float32 (or its stored float dtype), PyTorch layout.

        ``rows`` / ``cols`` (``(start, end)``, end exclusive) read only that slice of the
        first / second axis; only the slice's bytes count in :attr:`bytes_read`.

        Raises:
            WeightFormatError: the file has no tensor of that name.
        """
        self._check_name(name)
        tensor = self._read(name, rows, cols)
        self.tensors_read.append(name)
        return tensor

    def _check_name(self, name: str) -> None:
        if name not in self.names():
            raise WeightFormatError(f"tensor {name!r} is missing from the weights")


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
        self.path = Path(path)
        cache = _header_cache_file(self.path)
        try:
            header = json.loads(cache.read_text())
        except (OSError, ValueError):
            header = None
        self.reader = _reader_class()(str(self.path), header)
        self._tensors = {t.name: t for t in self.reader.tensors}
        if header is not None:
            self.metadata = header["metadata"]
        else:
            self.metadata = gguf_metadata(self.reader)
            if "general.alignment" not in self.reader.fields:  # the cache assumes the default
                try:
                    write_atomically(cache, json.dumps({"kv_end": self.reader.kv_end, "metadata": self.metadata}))
                except OSError:
                    pass  # no cache: the next open parses the file again
        self.config = ModelConfig.from_gguf_metadata(self.metadata, set(self._tensors))
        if "rope_freqs.weight" in self._tensors:
            self.rope_freq_factors = self.read("rope_freqs.weight").float()

    def names(self) -> set[str]:
        return set(self._tensors)

    def bits(self, name: str) -> float:
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self._tensors[name].tensor_type]
        return 8 * size / block

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    # Rows dequantized at a time when a column range cuts through the format's blocks.
    UNALIGNED_ROW_CHUNK = 64

    def _read(self, name: str, rows: Span, cols: Span) -> torch.Tensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        t = self._tensors[name]
        shape = self._shape(name)
        if rows is None and cols is None:
            self.bytes_read += int(t.n_bytes)
            return torch.from_numpy(self._decode(t.data, t.tensor_type).reshape(shape))
        # t.data is [rows, ...] for 1-D and 2-D tensors: elements for F32/F16, bytes for
        # BF16 and the block formats (a row is whole blocks).
        data = t.data if rows is None else t.data[rows[0] : rows[1]]
        if cols is None or len(shape) < 2:
            self.bytes_read += int(data.nbytes)
            return torch.from_numpy(self._decode(data, t.tensor_type).reshape(-1, *shape[1:]))
        c0, c1 = cols
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            part = data[:, c0:c1]
            self.bytes_read += int(part.nbytes)
            return torch.from_numpy(self._decode(part, t.tensor_type))
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        if c0 % block == 0 and (c1 % block == 0 or c1 == shape[1]):
            part = data[:, c0 // block * size : -(-c1 // block) * size]
            self.bytes_read += int(part.nbytes)
            return torch.from_numpy(self._decode(part, t.tensor_type))
        # The range cuts blocks: dequantize a few rows at a time and keep the columns.
        self.bytes_read += int(data.nbytes)
        step = self.UNALIGNED_ROW_CHUNK
        pieces = [
            self._decode(data[r : r + step], t.tensor_type)[:, c0:c1]
            for r in range(0, data.shape[0], step)
        ]
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(pieces)))

    @staticmethod
    def _decode(data: np.ndarray, tensor_type) -> np.ndarray:
        """float32 (F16 stays float16) elements of memory-mapped GGUF data, a new array."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return np.array(data, copy=True)
        if tensor_type == GGMLQuantizationType.BF16:
            raw = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
            return raw.view(np.float32)
        return np.ascontiguousarray(dequantize(np.ascontiguousarray(data), tensor_type))


def _header_cache_file(path: Path) -> Path:
    """Where the metadata of this GGUF file is kept, for every process on the machine."""
    return cache_path("gguf", path, ".json")


def _reader_class():
    """``gguf.GGUFReader`` that can skip its key/value section.

    The ``gguf`` library builds a memory-mapped view per element of every metadata array:
    seconds for a tokenizer's tens of thousands of strings, at every open. With ``header``
    (``{"kv_end", "metadata"}`` cached from a first full read) it jumps to the tensor infos,
    which it still reads itself.
    """
    from gguf import GGUFReader

    class HeaderCachedReader(GGUFReader):
        def __init__(self, path: str, header: dict | None) -> None:
            self._header = header
            super().__init__(path)

        def _build_fields(self, offs: int, count: int) -> int:
            if self._header is not None:
                return int(self._header["kv_end"])
            self.kv_end = super()._build_fields(offs, count)
            return self.kv_end

    return HeaderCachedReader


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

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def _read(self, name: str, rows: Span, cols: Span) -> torch.Tensor:
        handle = self._handles[self._where[name]]
        if rows is None and cols is None:
            tensor = handle.get_tensor(name)
        else:
            r = slice(*rows) if rows is not None else slice(None)
            tensor = handle.get_slice(name)[(r, slice(*cols)) if cols is not None else r]
            tensor = tensor.contiguous()
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
    source: WeightSource,
    layer_start: int,
    layer_end: int,
    dtype: torch.dtype,
    share: TensorShare | None = None,
    head: bool = True,
) -> dict[str, torch.Tensor]:
    """The state dict of :class:`~shardline.models.llama.DecoderShard` for a layer range.

    Reads only the tensors of layers ``[layer_start, layer_end)``, plus the embedding when
    ``layer_start == 0`` and, with ``head``, the final norm and head (the embedding when
    tied) when the range ends at the last layer. Every tensor is cast to ``dtype``.

    With a tensor ``share`` (the range must be the whole model) each layer's split tensors
    are read as slices: q rows of the share's heads, k/v rows of its KV heads, gate/up rows
    of its MLP columns, o columns of its heads and down columns of its MLP columns. Norms
    (and the embedding, final norm and head) are read whole: every rank holds them.

    Raises:
        WeightFormatError: a tensor is missing or has an unexpected shape.
    """
    config = source.config
    permuted = isinstance(source, GGUFSource) and config.architecture == "llama"
    out: dict[str, torch.Tensor] = {}
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_rows, kv_rows = config.num_heads * hd, config.num_kv_heads * hd

    def span(start: int, end: int, full: int) -> Span:
        return None if (start, end) == (0, full) else (start, end)

    if share is None:
        heads, kv_heads = config.num_heads, config.num_kv_heads
        q_span = kv_span = col_span = None
    else:
        share.check(config)
        heads, kv_heads = share.num_heads, share.num_kv_heads
        q_span = span(share.heads[0] * hd, share.heads[1] * hd, q_rows)
        kv0 = share.kv_heads[0]
        kv_span = span(kv0 * hd, (kv0 + kv_heads) * hd, kv_rows)
        col_span = span(*share.columns, inter)

    def get(layer: int | None, part: str) -> torch.Tensor:
        return source.read(_names(source, layer, part))

    def get_checked(label: str, layer: int | None, part: str, shape: tuple[int, ...],
                    rows: Span = None, cols: Span = None) -> torch.Tensor:
        """Check the file's whole shape, then read the slice."""
        name = _names(source, layer, part)
        found = source.shape(name)
        if found != shape:
            raise WeightFormatError(f"{label} has shape {found}, expected {shape}")
        return source.read(name, rows, cols)

    if layer_start == 0:
        out["embed.weight"] = get_checked(
            "embedding", None, "embed", (config.vocab_size, d)
        ).to(dtype)
    for local, layer in enumerate(range(layer_start, layer_end)):
        p = f"layers.{local}."
        q = get_checked(f"layer {layer} q", layer, "q", (q_rows, d), q_span)
        k = get_checked(f"layer {layer} k", layer, "k", (kv_rows, d), kv_span)
        v = get_checked(f"layer {layer} v", layer, "v", (kv_rows, d), kv_span)
        if permuted:  # llama.cpp permutes the rows within each head
            q = _unpermute_gguf_rope(q, heads)
            k = _unpermute_gguf_rope(k, kv_heads)
        out[p + "attn.qkv.weight"] = torch.cat((q, k, v)).to(dtype)
        if config.attention_bias:
            qb = source.read(_names(source, layer, "q_bias"), q_span)
            kb = source.read(_names(source, layer, "k_bias"), kv_span)
            vb = source.read(_names(source, layer, "v_bias"), kv_span)
            if permuted:
                qb = _unpermute_gguf_rope(qb, heads)
                kb = _unpermute_gguf_rope(kb, kv_heads)
            out[p + "attn.qkv.bias"] = torch.cat((qb, kb, vb)).to(dtype)
        out[p + "attn.o.weight"] = get_checked(
            f"layer {layer} o", layer, "o", (d, q_rows), cols=q_span
        ).to(dtype)
        if config.qk_norm:
            out[p + "attn.q_norm.weight"] = get(layer, "q_norm").to(dtype)
            out[p + "attn.k_norm.weight"] = get(layer, "k_norm").to(dtype)
        out[p + "attn_norm.weight"] = get(layer, "attn_norm").to(dtype)
        out[p + "mlp_norm.weight"] = get(layer, "mlp_norm").to(dtype)
        gate = get_checked(f"layer {layer} gate", layer, "gate", (inter, d), col_span)
        up = get_checked(f"layer {layer} up", layer, "up", (inter, d), col_span)
        out[p + "mlp.gate_up.weight"] = torch.cat((gate, up)).to(dtype)
        out[p + "mlp.down.weight"] = get_checked(
            f"layer {layer} down", layer, "down", (d, inter), cols=col_span
        ).to(dtype)
    if layer_end == config.num_layers and head:
        out["norm.weight"] = get(None, "norm").to(dtype)
        if config.tie_word_embeddings:
            lm_head = out.get("embed.weight")
            if lm_head is None:
                lm_head = get_checked("LM head", None, "embed", (config.vocab_size, d)).to(dtype)
        else:
            lm_head = get_checked("LM head", None, "head", (config.vocab_size, d)).to(dtype)
        out["lm_head.weight"] = lm_head
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
    return _build_shard(source, layer_start, layer_end, dtype, device, decode_rows)


def load_tensor_shard(
    source: WeightSource,
    share: TensorShare,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    decode_rows: int = 0,
    head: bool | None = None,
):
    """Build one tensor-parallel rank's :class:`~shardline.models.llama.DecoderShard`.

    It holds every layer, but of each only the share's heads, KV heads and MLP columns
    (read as slices, see :func:`shard_state_dict`), plus the whole token embedding on every
    rank and the final norm and LM head where ``head`` (default: on rank 0, the rank that
    samples; a tied head reuses the embedding). Its layers' outputs are partial sums until
    :class:`~shardline.parallel.tensor.TensorStage` sets the all-reduce. ``decode_rows`` as
    for :func:`load_shard`; the slices quantize exactly as the same rows and 32-column
    groups of the whole tensor do (int4 groups stay aligned when the column ranges are
    multiples of 32, as :mod:`shardline.placement.tensor` makes them).

    Raises:
        WeightFormatError: a tensor is missing or misshapen.
        ValueError: the share does not fit the model.
    """
    if head is None:
        head = share.rank == 0
    return _build_shard(source, 0, source.config.num_layers, dtype, device, decode_rows,
                        share=share, head=head)


def _build_shard(
    source: WeightSource,
    layer_start: int,
    layer_end: int,
    dtype: torch.dtype,
    device: torch.device | str,
    decode_rows: int,
    share: TensorShare | None = None,
    head: bool = True,
):
    from shardline.models.linear import Linear
    from shardline.models.llama import DecoderShard, rope_inverse_frequencies

    state = shard_state_dict(source, layer_start, layer_end, dtype, share=share, head=head)
    with torch.device("meta"):
        shard = DecoderShard(source.config, layer_start, layer_end, share=share, head=head)
    state = {k: v.to(device) for k, v in state.items()}
    missing, unexpected = shard.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise WeightFormatError(
            f"shard weights do not match: missing {missing}, unexpected {unexpected}"
        )
    shard.inv_freq = rope_inverse_frequencies(source.config, source.rope_freq_factors).to(device)
    for module in shard.modules():  # index buffers built on the CPU (see Attention)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != torch.device(device):
                setattr(module, name, buffer.to(device))
    if decode_rows > 0 and torch.device(device).type == "cpu":
        for name, module in shard.named_modules():
            if isinstance(module, Linear):
                bits = max(source.bits(n) for n in _linear_sources(source, name, layer_start))
                module.add_decode_copy(4 if bits <= 5.25 else 8, decode_rows)
    shard.eval()
    return shard
