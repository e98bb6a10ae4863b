"""What Ollama's ``/api/show``, ``/api/tags`` and ``/api/ps`` tell of a model: its digest,
its ``details`` (format, family, parameter size, quantization), ``model_info`` (GGUF-style
keys) and chat template.

The **digest** is the SHA-256 (hex) of the canonical JSON (sorted keys, no spaces) of the
model's file list as its manifest records it, ``{"model_id", "format", "files": [{"path",
"size", "sha256", "weights"}]}`` (:class:`~shardline.models.store.Manifest`): the same
files give the same digest on every node, and any change of a file changes it. The
embedded default, which has no manifest, is described the same way from its GGUF file.

Shapes follow Ollama's docs/api.md ("Show Model Information", "List Local Models", "List
Running Models"); ``parameter_size`` is written as Ollama's ``format.HumanNumber`` writes it
("134.52M", "7.6B", "8B").
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardline.models.config import ModelConfig
from shardline.models.store import DEFAULT_MODEL_ID, Manifest, ModelFile, default_model_path, sha256_file

if TYPE_CHECKING:
    from shardline.node.node import Node
    from shardline.node.table import Instance

_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_QUANT_IN_NAME = re.compile(r"(?i)(?<![A-Z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Z0-9])")


def manifest_digest(model_id: str, fmt: str, files: list[dict[str, Any]]) -> str:
    """``sha256:``-less hex digest of a model's file list (see the module doc); ``files``
    as ``Manifest.to_dict()["files"]`` gives them."""
    text = json.dumps({"model_id": model_id, "format": fmt, "files": files}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def parameter_count(config: dict[str, Any]) -> int:
    """Parameters of a model from its ``ModelConfig.to_dict()``: the embedding, every
    layer (:meth:`~shardline.models.config.ModelConfig.layer_param_count`: every expert of
    a mixture of experts), the final norm and an untied output head; biases and q/k norms
    are left out (a rounding error)."""
    d = config["hidden_size"]
    layer = ModelConfig.from_dict(config).layer_param_count()
    embed = config["vocab_size"] * d
    return embed + config["num_layers"] * layer + d + (0 if config["tie_word_embeddings"] else embed)


def human_number(n: int) -> str:
    """``n`` as Ollama's ``format.HumanNumber`` writes it: ``8B``, ``7.6B``, ``135M``,
    ``134.52M``, ``12K``, ``999``."""
    for scale, unit, decimals in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 0)):
        if n >= scale:
            value = n / scale
            if unit == "K" or value == math.floor(value):
                return f"{value:.0f}{unit}"
            return f"{value:.{decimals}f}{unit}"
    return str(n)


def gguf_quantization(file_type: int | None, file_name: str) -> str:
    """A GGUF model's quantization as Ollama names it (``Q4_K_M``, ``Q8_0``, ``F16``):
    from its ``general.file_type`` (llama.cpp's ``llama_ftype``, through ``gguf``'s
    ``LlamaFileType``), else from a tag in the file's name, else ``"unknown"``."""
    if file_type is not None:
        from gguf import LlamaFileType

        try:
            return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    tags = _QUANT_IN_NAME.findall(Path(file_name).stem)
    return tags[-1].upper() if tags else "unknown"


def dtype_quantization(dtype: str | None) -> str:
    """A safetensors model's ``quantization_level``: its ``torch_dtype`` as GGUF names it
    (``bfloat16`` -> ``BF16``), else ``"unknown"``."""
    return _DTYPES.get(str(dtype), "unknown")


@dataclass(frozen=True)
class ModelFacts:
    """One model as Ollama's endpoints describe it.

    Attributes:
        model_id: its id; format: ``gguf`` or ``safetensors``; digest: see the module doc;
        file_bytes: bytes of its weight files; config: ``ModelConfig.to_dict()``;
        quantization: ``quantization_level``; metadata: a GGUF file's scalar ``general.*``
        and architecture keys (empty for safetensors).
    """

    model_id: str
    format: str
    digest: str
    file_bytes: int
    config: dict[str, Any]
    quantization: str
    metadata: dict[str, Any]

    def details(self) -> dict[str, Any]:
        """Ollama's ``details``."""
        family = self.config["architecture"]
        return {
            "parent_model": "",
            "format": self.format,
            "family": family,
            "families": [family],
            "parameter_size": human_number(parameter_count(self.config)),
            "quantization_level": self.quantization,
        }

    def model_info(self) -> dict[str, Any]:
        """Ollama's ``model_info``: GGUF-style keys from the config, then the GGUF file's own."""
        c, arch = self.config, self.config["architecture"]
        info = {
            "general.architecture": arch,
            "general.parameter_count": parameter_count(c),
            f"{arch}.context_length": c["max_position_embeddings"],
            f"{arch}.embedding_length": c["hidden_size"],
            f"{arch}.block_count": c["num_layers"],
            f"{arch}.feed_forward_length": c["intermediate_size"],
            f"{arch}.attention.head_count": c["num_heads"],
            f"{arch}.attention.head_count_kv": c["num_kv_heads"],
            f"{arch}.vocab_size": c["vocab_size"],
            f"{arch}.rope.freq_base": c["rope_theta"],
        }
        if c.get("num_experts"):
            info.update(
                {f"{arch}.expert_count": c["num_experts"], f"{arch}.expert_used_count": c["num_experts_per_tok"]}
            )
        info.update({k: v for k, v in self.metadata.items() if k.startswith(("general.", f"{arch}."))})
        return info


@functools.cache
def _default_files() -> tuple[ModelFile, ...]:
    """The embedded default's file, as a manifest would list it (hashed once per process)."""
    path = default_model_path()
    return (ModelFile(path.name, path.stat().st_size, sha256_file(path), True),)


def _read_facts(node: Node, model_id: str, manifest: Manifest | None, config: dict[str, Any]) -> ModelFacts:
    """Blocking part of :func:`model_facts`: hash the default's file, read a GGUF's
    metadata (cached per machine by :mod:`shardline.models.gguf_header`) or a safetensors
    directory's ``config.json`` where this node has them."""
    if manifest is None:  # the embedded default
        files, fmt = _default_files(), "gguf"
    else:
        files, fmt = manifest.files, manifest.format
    weights = [f for f in files if f.weights]
    metadata: dict[str, Any] = {}
    if fmt == "gguf":
        try:
            from shardline.models.gguf_header import open_gguf

            _, meta = open_gguf(node.store.weights_path(model_id))
            metadata = {k: v for k, v in meta.items() if not isinstance(v, list) and not k.startswith("tokenizer.")}
        except (OSError, ValueError, LookupError):  # not (wholly) on this node
            pass
        quantization = gguf_quantization(metadata.get("general.file_type"), weights[0].path if weights else "")
    else:
        try:
            hf = json.loads((node.store.model_dir(model_id) / "config.json").read_text())
        except (OSError, ValueError):
            hf = {}
        quantization = dtype_quantization(hf.get("torch_dtype") or hf.get("dtype"))
    digest = manifest_digest(model_id, fmt, [dataclasses.asdict(f) for f in files])
    return ModelFacts(model_id, fmt, digest, sum(f.size for f in weights), config, quantization, metadata)


async def model_facts(node: Node, model_id: str, cache: dict[str, ModelFacts]) -> ModelFacts:
    """The facts of a model this node or a live peer holds, computed once per node and
    model (``cache``).

    Raises:
        ModelNotFoundError: no live node has the model.
    """
    if model_id not in cache:
        manifest = None if model_id == DEFAULT_MODEL_ID else await node.logistics.manifest(model_id)
        card = await node.logistics.model_card(model_id)
        cache[model_id] = await asyncio.to_thread(_read_facts, node, model_id, manifest, card.config)
    return cache[model_id]


def placed(node: Node, model_id: str) -> list[Instance]:
    """The instances of ``model_id`` in the node's table, whatever their status."""
    return [i for i in node.instances.values() if i.model_id == model_id]


def held_bytes(inst: Instance) -> tuple[int, int]:
    """Bytes the ranks of ``inst`` hold (parameters and KV pool, as their runners
    reported), and of those the bytes on a GPU (a rank whose report names a ``cuda``
    device: ``shardline run --device``)."""
    total = vram = 0
    for rank in inst.ranks:
        loaded = rank.loaded or {}
        size = int(loaded.get("param_bytes", 0)) + int(loaded.get("kv_cache_bytes", 0))
        total += size
        if str(loaded.get("device", "cpu")).startswith("cuda"):
            vram += size
    return total, vram
