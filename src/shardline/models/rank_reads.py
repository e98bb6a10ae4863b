"""Which tensors of a model's file a rank reads: the one rule, for copying and for tests.

A rank's runner reads (:func:`shardline.models.shard_loader.shard_tensors`):

- the tensors of the layers it holds (``blk.{i}.*`` in GGUF, ``model.layers.{i}.*`` in a
  Hugging Face checkpoint): a pipeline or ring rank its share's layer range, a tensor rank
  every layer (it reads a slice of each tensor, and skips a few that rank 0 alone adds,
  such as an output bias; a slice is not one byte range of the file, so a tensor rank
  copies every layer's tensors whole);
- the token embedding where its range starts at layer 0, and on every tensor rank;
- the final norm and the LM head where it computes logits: a pipeline or ring rank whose
  range ends at the last layer, tensor rank 0; the head of a model with tied embeddings is
  the token embedding;
- ``rope_freqs.weight`` (GGUF's per-frequency RoPE factors) wherever the file has it.

Nothing else: a tensor of no layer and none of these names is read by no rank. This
module is pure and imports neither torch nor the file readers: the node decides what to
copy from the manifest's tensor names and the model card (``ModelConfig.to_dict()``).
The names mirror :class:`~shardline.models.weights.GGUFSource` and
``SafetensorsSource``'s (the tests check them against what the loader reads).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from shardline.models.config import RankShare, Sharding


@dataclass(frozen=True)
class Naming:
    """How a file format names the tensors :func:`tensors_read` sorts."""

    embed: str
    norm: str
    head: str
    layer: re.Pattern[str]  # group 1: the layer index
    everywhere: tuple[str, ...] = ()  # read by every rank where present


GGUF_NAMING = Naming(
    "token_embd.weight", "output_norm.weight", "output.weight", re.compile(r"blk\.(\d+)\."), ("rope_freqs.weight",)
)
HF_NAMING = Naming("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", re.compile(r"\.layers\.(\d+)\."))
NAMINGS = {"gguf": GGUF_NAMING, "safetensors": HF_NAMING}


@dataclass(frozen=True)
class RankReads:
    """What a rank reads, by kind: layers ``[layer_start, layer_end)``, the token
    embedding (``embed``), the final norm and LM head (``head``)."""

    layer_start: int
    layer_end: int
    embed: bool
    head: bool

    @classmethod
    def of(cls, sharding: Sharding | str, rank: int, share: RankShare, num_layers: int) -> "RankReads":
        """What rank ``rank`` of an instance of ``sharding`` holding ``share`` of a model of
        ``num_layers`` layers reads (see the module doc)."""
        if Sharding(sharding) in (Sharding.TENSOR, Sharding.EXPERT):
            return cls(0, num_layers, embed=True, head=rank == 0)
        return cls(share.layer_start, share.layer_end, embed=share.layer_start == 0, head=share.layer_end == num_layers)

    @classmethod
    def whole(cls, num_layers: int) -> "RankReads":
        """Every tensor a rank can read: a one-rank instance's."""
        return cls(0, num_layers, embed=True, head=True)


def tensors_read(names: Iterable[str], naming: Naming, tied: bool, reads: RankReads) -> frozenset[str]:
    """The names among ``names`` (a file's tensors) that a rank reading ``reads`` reads;
    ``tied``: the model's LM head is its token embedding."""
    out = set()
    for name in names:
        match = naming.layer.search(name)
        if match is not None:
            wanted = reads.layer_start <= int(match.group(1)) < reads.layer_end
        elif name == naming.embed:
            wanted = reads.embed or (reads.head and tied)
        elif name in (naming.norm, naming.head):
            wanted = reads.head
        else:
            wanted = name in naming.everywhere
        if wanted:
            out.add(name)
    return frozenset(out)


def rank_tensors(
    names: Iterable[str], fmt: str, config: dict, sharding: Sharding | str, rank: int, share: RankShare
) -> frozenset[str]:
    """The tensors among ``names`` of a model in format ``fmt`` ("gguf" or "safetensors")
    with card ``config`` (``ModelConfig.to_dict()``) that rank ``rank`` of an instance of
    ``sharding`` holding ``share`` reads."""
    reads = RankReads.of(sharding, rank, share, int(config["num_layers"]))
    return tensors_read(names, NAMINGS[fmt], bool(config["tie_word_embeddings"]), reads)
