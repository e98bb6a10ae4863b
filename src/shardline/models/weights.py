"""Reading a model's tensors from GGUF files or Hugging Face safetensors directories.

Both formats are memory-mapped, so the bytes of tensors a rank does not read are never
read; :attr:`WeightSource.bytes_read` counts what was. A slice (a range of rows, or of
columns) reads only its bytes: safetensors through ``get_slice``; GGUF by slicing the
memory-mapped blocks (rows always; columns on the format's block boundaries, otherwise
a few rows at a time, keeping only the wanted columns).

:meth:`WeightSource.read_weight` gives a quantized GGUF weight as the file stores it
(:class:`~shardline.models.gguf_quants.GroupQuant`, exact); :meth:`WeightSource.read` gives
float values. Which tensors a rank reads is :mod:`shardline.models.shard_loader`'s.

Formats:
- GGUF: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, read with the ``gguf``
  library (metadata, tensor infos, and the float values of types with no integer-group
  form here).
- safetensors: https://huggingface.co/docs/safetensors, read with ``safe_open``.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np
import torch

from shardline.models import native_dequant
from shardline.models.config import ModelConfig
from shardline.models.gguf_header import gguf_config, open_gguf
from shardline.models.gguf_quants import SUPPORTED_TYPES, GroupQuant

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

    def _read(self, name: str, rows: Span, cols: Span, expert: int | None) -> torch.Tensor:
        raise NotImplementedError

    def expert_tensor(self, layer: int, part: str, expert: int) -> tuple[str, int | None]:
        """Where expert ``expert``'s ``part`` ("gate", "up" or "down") of global ``layer``
        is: a tensor name and, for a file that stores a layer's experts as one 3-D tensor
        ``[experts, rows, cols]`` (GGUF), the expert's index in it (None: the tensor is
        this expert's own)."""
        raise NotImplementedError

    def router_tensor(self, layer: int) -> str:
        """The name of ``layer``'s router weight ``[experts, hidden]`` (its bias, where the
        model has one: the same name ending ``.bias``)."""
        raise NotImplementedError

    def expert_bias_tensor(self, layer: int, part: str) -> str:
        """The name of ``layer``'s biases of every expert's ``part`` ("gate", "up" or
        "down"): ``[experts, rows]``."""
        raise NotImplementedError

    def shape(self, name: str, expert: int | None = None) -> tuple[int, ...]:
        """The shape of tensor ``name`` in PyTorch layout (of one expert's slice of a 3-D
        expert tensor where ``expert`` is given), without reading it.

        Raises:
            WeightFormatError: the file has no tensor of that name.
        """
        self._check_name(name)
        shape = self._shape(name)
        if expert is not None:
            if len(shape) != 3 or not 0 <= expert < shape[0]:
                raise WeightFormatError(f"tensor {name!r} of shape {shape} has no expert {expert}")
            return shape[1:]
        return shape

    def read(self, name: str, rows: Span = None, cols: Span = None, expert: int | None = None) -> torch.Tensor:
        """The tensor ``name`` as float32 (or its stored float dtype), PyTorch layout.

        ``rows`` / ``cols`` (``(start, end)``, end exclusive) read only that slice of the
        first / second axis (of the expert's 2-D slice of a 3-D expert tensor where
        ``expert`` is given); only the slice's bytes count in :attr:`bytes_read`.

        Raises:
            WeightFormatError: the file has no tensor of that name.
        """
        self.shape(name, expert)
        tensor = self._read(name, rows, cols, expert)
        self._note_read(name)
        self._release(name)
        return tensor

    def _note_read(self, name: str) -> None:
        """Count ``name`` in :attr:`tensors_read` (once for consecutive reads of its row
        blocks)."""
        if not self.tensors_read or self.tensors_read[-1] != name:
            self.tensors_read.append(name)

    def read_weight(
        self, name: str, rows: Span = None, cols: Span = None, expert: int | None = None
    ) -> torch.Tensor | GroupQuant:
        """A linear weight as the file stores it: :class:`GroupQuant` for a quantized
        GGUF type that has an exact integer-group form and whose column range falls on
        its groups, else the float tensor of :meth:`read` (``expert`` as there).

        Raises:
            WeightFormatError: the file has no tensor of that name.
        """
        return self.read(name, rows, cols, expert)

    def _release(self, name: str) -> None:
        """Called once tensor ``name`` is read into memory of its own: a source may let
        go of the file bytes behind it."""

    def _check_name(self, name: str) -> None:
        if name not in self.names():
            raise WeightFormatError(f"tensor {name!r} is missing from the weights")


class GGUFSource(WeightSource):
    """Weights and configuration from one GGUF file (memory-mapped)."""

    TOP_NAMES = {"embed": "token_embd.weight", "norm": "output_norm.weight", "head": "output.weight"}
    LAYER_FORMAT = "blk.{layer}.{name}"
    LAYER_NAMES = {
        "attn_norm": "attn_norm.weight",
        "mlp_norm": "ffn_norm.weight",
        "q": "attn_q.weight",
        "k": "attn_k.weight",
        "v": "attn_v.weight",
        "q_bias": "attn_q.bias",
        "k_bias": "attn_k.bias",
        "v_bias": "attn_v.bias",
        "o": "attn_output.weight",
        "q_norm": "attn_q_norm.weight",
        "k_norm": "attn_k_norm.weight",
        "gate": "ffn_gate.weight",
        "up": "ffn_up.weight",
        "down": "ffn_down.weight",
        "o_bias": "attn_output.bias",
        "sinks": "attn_sinks.weight",
    }

    def expert_tensor(self, layer: int, part: str, expert: int) -> tuple[str, int | None]:
        return f"blk.{layer}.ffn_{part}_exps.weight", expert

    def expert_bias_tensor(self, layer: int, part: str) -> str:
        return f"blk.{layer}.ffn_{part}_exps.bias"

    def router_tensor(self, layer: int) -> str:
        return f"blk.{layer}.ffn_gate_inp.weight"

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.reader, self.metadata = open_gguf(self.path)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.config = gguf_config(self.reader, self.metadata)
        if self.config.architecture == "gpt-oss":  # llama.cpp names its second norm so
            self.LAYER_NAMES = dict(self.LAYER_NAMES, mlp_norm="post_attention_norm.weight")
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

    def read_weight(
        self, name: str, rows: Span = None, cols: Span = None, expert: int | None = None
    ) -> torch.Tensor | GroupQuant:
        from gguf import GGML_QUANT_SIZES

        t = self._tensors[name] if name in self._tensors else None
        if t is None or t.tensor_type.name not in SUPPORTED_TYPES or len(self.shape(name, expert)) != 2:
            return self.read(name, rows, cols, expert)
        type_name = t.tensor_type.name
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        data = t.data if expert is None else t.data[expert]
        data = data if rows is None else data[rows[0] : rows[1]]
        if cols is None:
            part = data
        else:
            first = cols[0] // block
            part = data[:, first * size : -(-cols[1] // block) * size]
        groups = native_dequant.unpack_blocks(type_name, part)
        if cols is not None:
            try:
                groups = groups.cols(cols[0] - first * block, cols[1] - first * block)
            except ValueError:  # the range cuts groups: exact floats
                return self.read(name, rows, cols, expert)
        self.bytes_read += int(part.nbytes)
        self._note_read(name)
        groups = groups.contiguous()
        self._release(name)
        return groups

    def _release(self, name: str) -> None:
        """Let the kernel drop the file pages of a tensor already read (every read copies
        out of the mapping), so a loading rank's memory does not also hold the file's
        bytes (they are clean, read-only pages: read again on demand)."""
        tensor = self._tensors[name]
        mapping = getattr(self.reader.data, "_mmap", None)
        if mapping is None or not hasattr(mapping, "madvise"):
            return
        page = mmap.PAGESIZE
        start = -(-int(tensor.data_offset) // page) * page
        end = (int(tensor.data_offset) + int(tensor.n_bytes)) // page * page
        if end > start:
            try:
                mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):
                pass

    # Rows dequantized at a time when a column range cuts through the format's blocks.
    UNALIGNED_ROW_CHUNK = 64

    def _read(self, name: str, rows: Span, cols: Span, expert: int | None) -> torch.Tensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        t = self._tensors[name]
        shape, data = self._shape(name), t.data
        if expert is not None:  # one expert's [rows, cols] of a 3-D expert tensor
            shape, data = shape[1:], data[expert]
        if rows is None and cols is None:
            self.bytes_read += int(data.nbytes)
            return torch.from_numpy(self._decode(data, t.tensor_type).reshape(shape))
        # data is [rows, ...] for 1-D and 2-D tensors: elements for F32/F16, bytes for
        # BF16 and the block formats (a row is whole blocks).
        data = data if rows is None else data[rows[0] : rows[1]]
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
        pieces = [self._decode(data[r : r + step], t.tensor_type)[:, c0:c1] for r in range(0, data.shape[0], step)]
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


class SafetensorsSource(WeightSource):
    """Weights from a Hugging Face model directory (config.json + *.safetensors)."""

    TOP_NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
    LAYER_FORMAT = "model.layers.{layer}.{name}"
    LAYER_NAMES = {
        "attn_norm": "input_layernorm.weight",
        "mlp_norm": "post_attention_layernorm.weight",
        "q": "self_attn.q_proj.weight",
        "k": "self_attn.k_proj.weight",
        "v": "self_attn.v_proj.weight",
        "q_bias": "self_attn.q_proj.bias",
        "k_bias": "self_attn.k_proj.bias",
        "v_bias": "self_attn.v_proj.bias",
        "o": "self_attn.o_proj.weight",
        "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight",
        "gate": "mlp.gate_proj.weight",
        "up": "mlp.up_proj.weight",
        "down": "mlp.down_proj.weight",
    }
    # Where a layer's router and experts are, by the checkpoint's model_type: Mixtral's
    # w1, w3 and w2 are the gate, up and down projections.
    MOE_NAMES = {
        "mixtral": (
            "block_sparse_moe.gate.weight",
            {
                "gate": "block_sparse_moe.experts.{expert}.w1.weight",
                "up": "block_sparse_moe.experts.{expert}.w3.weight",
                "down": "block_sparse_moe.experts.{expert}.w2.weight",
            },
        ),
        "qwen3_moe": (
            "mlp.gate.weight",
            {part: f"mlp.experts.{{expert}}.{part}_proj.weight" for part in ("gate", "up", "down")},
        ),
    }

    def expert_tensor(self, layer: int, part: str, expert: int) -> tuple[str, int | None]:
        name = self.MOE_NAMES[self.model_type][1][part].format(expert=expert)
        return self.LAYER_FORMAT.format(layer=layer, name=name), None

    def router_tensor(self, layer: int) -> str:
        return self.LAYER_FORMAT.format(layer=layer, name=self.MOE_NAMES[self.model_type][0])

    def __init__(self, directory: str | Path) -> None:
        super().__init__()
        from safetensors import safe_open

        self.path = Path(directory)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise WeightFormatError(f"{self.path} has no config.json")
        hf_config = json.loads(config_file.read_text())
        self.config = ModelConfig.from_hf_config(hf_config)
        self.model_type = hf_config.get("model_type", "")
        if self.config.is_moe and self.model_type not in self.MOE_NAMES:
            raise WeightFormatError(
                f"a mixture of experts of model_type {self.model_type!r}: its expert "
                f"tensors' names are not known (known: {', '.join(self.MOE_NAMES)})"
            )
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

    def _read(self, name: str, rows: Span, cols: Span, expert: int | None) -> torch.Tensor:
        handle = self._handles[self._where[name]]
        if expert is not None:
            raise WeightFormatError(f"{name!r}: this checkpoint stores each expert's own tensor")
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
    raise WeightFormatError(f"{path} is neither a .gguf file nor a directory with config.json and safetensors")
