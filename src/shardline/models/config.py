"""Model configuration shared by the Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral families.

One decoder serves all of them; the differences live here:

- Llama (Llama 2/3, Mistral, SmolLM): no projection bias, no q/k norm.
- Qwen2: bias on the q, k and v projections.
- Qwen3: RMSNorm over each head of q and k before RoPE; explicit head_dim.
- Mixtral: Llama's attention; every layer's MLP is a mixture of experts
  (``num_experts`` SwiGLU experts of ``intermediate_size`` columns, ``num_experts_per_tok``
  chosen per token). GGUF calls it ``llama`` with an ``expert_count``.
- Qwen3-MoE (``qwen3moe``): Qwen3's attention with Mixtral's kind of MoE layers
  (``moe_intermediate_size`` wide experts; the top-k weights renormalized where
  ``norm_topk_prob``).
- gpt-oss (``gpt-oss``; transformers' ``GptOssForCausalLM`` is the reference): biases on
  q/k/v and the attention output, a learned attention sink per head, a sliding window on
  alternate layers (``sliding_layers``), YaRN RoPE, and MoE layers whose router and experts
  have biases and whose SwiGLU is clamped (``swiglu_limit``, ``swiglu_alpha``). Read from
  GGUF only (the Hub's checkpoints hold MXFP4 blocks in a layout of their own).

A mixture-of-experts model here has experts in every layer: ``intermediate_size`` is then
an expert's width (Qwen3-MoE's ``moe_intermediate_size``). Models that mix dense and MoE
layers (Qwen3-MoE's ``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused.

Read from Hugging Face ``config.json`` (``from_hf_config``) or GGUF metadata
(``from_gguf_metadata``, keys as documented in the GGUF spec,
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum, StrEnum
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss")

_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
_HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
}


class UnsupportedModelError(ValueError):
    """The model's architecture or configuration is not one shardline can run."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    All sizes are element counts; ``rope_theta`` is RoPE's base; ``rms_norm_eps`` is the
    epsilon added to the mean square in RMSNorm.

    A mixture-of-experts model has ``num_experts`` > 0 experts in every layer, of which
    each token uses ``num_experts_per_tok``, each ``intermediate_size`` wide; the router's
    softmax over all experts is taken top-k, and those k weights divided by their sum
    where ``norm_topk_prob`` (Mixtral always, Qwen3-MoE as its config says; gpt-oss's
    softmax over the top k logits is the same weights).

    gpt-oss's parts: the layers in ``sliding_layers`` attend to the last
    ``sliding_window`` positions only (key j seen from query i where i - j < window);
    ``attention_sinks``: a learned logit per head joins each query's softmax and is
    dropped; ``output_bias``: the attention output projection has a bias;
    ``expert_bias``: the router and each expert's projections have biases;
    ``swiglu_limit`` > 0: the experts' activation is gpt-oss's clamped one,
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate,
    limit)``, where 0 means SwiGLU.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    attention_sinks: bool = False
    output_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0

    @property
    def is_moe(self) -> bool:
        """Whether every layer's MLP is a mixture of experts."""
        return self.num_experts > 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))  # from JSON lists
        kind = (self.rope_scaling or {}).get("rope_type") or (self.rope_scaling or {}).get("type")
        if kind not in (None, "default", "llama3", "linear", "yarn"):
            raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported (supported: llama3, linear, yarn)")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads do not group evenly over {self.num_kv_heads} KV heads"
            )
        if self.architecture == "qwen3moe" and not self.is_moe:
            raise UnsupportedModelError("a qwen3moe model needs an expert count")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"the router chooses {self.num_experts_per_tok} experts per token of "
                f"{self.num_experts}: it must choose between 1 and {self.num_experts}"
            )

    def window_of(self, layer: int) -> int:
        """The sliding window of global ``layer`` in positions, 0 where it sees them all."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def kv_head_of(self, head: int) -> int:
        """The KV head that query head ``head`` attends with (grouped-query attention)."""
        return head // (self.num_heads // self.num_kv_heads)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON has them (``sliding_layers`` a list), so a manifest read back
        equals the one written."""
        data = asdict(self)
        data["sliding_layers"] = list(self.sliding_layers)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return cls(**data)

    def layer_param_count(self) -> int:
        """Parameters in one decoder layer (weights only, norms included; every expert
        and the router of an MoE layer)."""
        return self._layer_params(self.num_experts or 1)

    def active_layer_param_count(self) -> int:
        """Parameters of one decoder layer that a token reads: as
        :meth:`layer_param_count`, but of an MoE layer only the router and the
        ``num_experts_per_tok`` experts a token is routed to."""
        return self._layer_params(self.num_experts_per_tok or 1)

    def _layer_params(self, experts: int) -> int:
        d, h = self.hidden_size, self.head_dim
        q = d * self.num_heads * h
        kv = 2 * d * self.num_kv_heads * h
        o = self.num_heads * h * d
        mlp = experts * 3 * d * self.intermediate_size + self.num_experts * d  # + router
        return q + kv + o + mlp + 2 * d

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """KV-cache bytes one token takes across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict.

        Raises:
            UnsupportedModelError: the architecture is not Llama, Mistral, Qwen2 or Qwen3.
        """
        names = cfg.get("architectures") or []
        arch = next((_HF_ARCHITECTURES[n] for n in names if n in _HF_ARCHITECTURES), None)
        if arch is None:
            arch = _HF_MODEL_TYPES.get(cfg.get("model_type", ""))
        if arch is None and (cfg.get("model_type") == "gpt_oss" or "GptOssForCausalLM" in names):
            raise UnsupportedModelError(
                "gpt-oss is supported from GGUF files (e.g. ggml-org/gpt-oss-20b-GGUF), not "
                "from its safetensors checkpoints (MXFP4 blocks in a layout of their own)"
            )
        if arch is None:
            raise UnsupportedModelError(
                f"model architectures {names or cfg.get('model_type')!r} are not supported "
                f"(supported: {', '.join(sorted(_HF_ARCHITECTURES))})"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers 5 writes rope_theta and the scaling inside "rope_parameters".
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        inter = cfg["intermediate_size"]
        if experts:
            if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
                raise UnsupportedModelError(
                    "a model whose layers mix dense MLPs and experts (mlp_only_layers, "
                    "decoder_sparse_step) is not supported"
                )
            inter = cfg.get("moe_intermediate_size") or inter
        return cls(
            architecture=arch,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=hidden,
            intermediate_size=inter,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3moe"),
            rope_scaling=scaling,
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            # Mixtral renormalizes always (its config has no such key).
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str], embedding_rows: int = 0) -> "ModelConfig":
        """Build from GGUF key/value metadata, the file's tensor names and the token
        embedding's rows (the vocabulary, where the metadata has no ``vocab_size``).

        Raises:
            UnsupportedModelError: ``general.architecture`` is not one of
                :data:`SUPPORTED_ARCHITECTURES`.
        """
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        vocab = key("vocab_size") or embedding_rows
        rope_scaling = None
        if key("rope.scaling.type") not in (None, "none"):
            rope_scaling = {
                "rope_type": key("rope.scaling.type"),
                "factor": key("rope.scaling.factor"),
                "original_max_position_embeddings": key("rope.scaling.original_context_length"),
            }
            if rope_scaling["rope_type"] == "yarn":  # llama.cpp's defaults, gpt-oss's config
                rope_scaling.update(
                    beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)),
                    truncate=arch != "gpt-oss",
                )
        oss = arch == "gpt-oss"  # llama.cpp: a window on even layers, the clamped SwiGLU
        experts = int(key("expert_count", 0) or 0)
        # llama.cpp renormalizes the chosen experts' weights of both families (Mixtral's
        # softmax-top-k is that; Qwen3-MoE checkpoints set norm_topk_prob).
        inter = int(key("expert_feed_forward_length", 0) or 0) if experts else 0
        return cls(
            architecture=arch,
            num_layers=int(key("block_count")),
            hidden_size=hidden,
            intermediate_size=inter or int(key("feed_forward_length")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=int(key("attention.key_length", hidden // num_heads)),
            vocab_size=int(vocab),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            rope_scaling=rope_scaling,
            num_experts=experts,
            num_experts_per_tok=int(key("expert_used_count", 0) or 0) if experts else 0,
            norm_topk_prob=bool(key("expert_weights_norm", True)),
            sliding_window=int(key("attention.sliding_window", 0) or 0) if oss else 0,
            sliding_layers=tuple(range(0, int(key("block_count")), 2)) if oss else (),
            attention_sinks="blk.0.attn_sinks.weight" in tensor_names,
            output_bias="blk.0.attn_output.bias" in tensor_names,
            expert_bias="blk.0.ffn_gate_exps.bias" in tensor_names,
            swiglu_limit=7.0 if oss else 0.0,
            swiglu_alpha=1.702 if oss else 1.0,
        )


@dataclass(frozen=True)
class TensorShare:
    """One rank's part of every decoder layer under tensor parallelism.

    The split of Megatron-LM (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion
    Parameter Language Models Using Model Parallelism", section 3): the q/k/v projections
    and the MLP gate/up projections are split by output (a rank computes whole heads and a
    range of intermediate columns), the attention output projection and the MLP down
    projection by input (the same heads and columns), so every rank ends each block with a
    partial sum of the full ``[N, hidden_size]`` output, which an all-reduce completes.

    Attributes:
        rank, world_size: this rank among the instance's tensor ranks.
        heads: ``(start, end)``, the query heads of this rank (end exclusive).
        kv_heads: the KV heads these query heads read, consecutive and ascending. With
            grouped-query attention a KV head whose query heads span two ranks is held (and
            computed) by both.
        columns: ``(start, end)``, this rank's MLP intermediate columns (of every expert
            of an MoE layer).
        experts: under expert sharding (:attr:`Sharding.EXPERT`), ``(start, end)``: the
            whole experts of every MoE layer this rank holds (``columns`` is then all of
            them); None where every rank holds a slice of every expert.
    """

    rank: int
    world_size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, ...]
    columns: tuple[int, int]
    experts: tuple[int, int] | None = None

    def expert_range(self, config: ModelConfig) -> tuple[int, int]:
        """The experts of each MoE layer this rank holds (a part of them or all)."""
        return self.experts if self.experts is not None else (0, config.num_experts)

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def num_columns(self) -> int:
        return self.columns[1] - self.columns[0]

    def local_kv_heads(self, config: ModelConfig) -> list[int]:
        """For each local query head, the index of its KV head among ``kv_heads``."""
        first = self.kv_heads[0]
        return [config.kv_head_of(h) - first for h in range(*self.heads)]

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError unless this share fits ``config``'s shapes."""
        start, end = self.heads
        if not 0 <= start < end <= config.num_heads:
            raise ValueError(f"head range {self.heads} is not inside [0, {config.num_heads})")
        needed = sorted({config.kv_head_of(h) for h in range(start, end)})
        kv = list(self.kv_heads)
        if kv != list(range(needed[0], needed[-1] + 1)):
            raise ValueError(
                f"KV heads {self.kv_heads} are not the KV heads {tuple(needed)} that query heads [{start}, {end}) read"
            )
        c0, c1 = self.columns
        if not 0 <= c0 < c1 <= config.intermediate_size:
            raise ValueError(f"MLP column range {self.columns} is not inside [0, {config.intermediate_size})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world_size})")
        if self.experts is not None:
            e0, e1 = self.experts
            if not config.is_moe or not 0 <= e0 < e1 <= config.num_experts:
                raise ValueError(f"expert range {self.experts} is not inside [0, {config.num_experts}) experts")
            if self.columns != (0, config.intermediate_size):
                raise ValueError("a rank that holds whole experts holds all their columns")


@dataclass(frozen=True)
class RankShare:
    """What one rank of an instance holds: the layers ``[layer_start, layer_end)`` and,
    under tensor sharding, its heads and MLP columns of each of them (``tensor_share``;
    None where a rank holds whole layers: pipeline, ring, and tensor on one rank). The one
    type placement decides (``shardline.placement.ranks``), the instance table records
    (``shardline.node.table.RankPlacement``) and a runner loads
    (``shardline.runner.protocol.RunnerSpec``)."""

    layer_start: int
    layer_end: int
    tensor_share: TensorShare | None = None

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


class Sharding(StrEnum):
    """How an instance's model is split across its ranks."""

    PIPELINE = "pipeline"
    """Each rank holds a range of layers; activations go rank to rank."""
    TENSOR = "tensor"
    """Each rank holds every layer's share of the heads and MLP columns; all-reduce."""
    RING = "ring"
    """Each rank holds the whole model; prompts are split across the ranks (ring
    attention), decode runs on every rank."""
    EXPERT = "expert"
    """Tensor's split of the attention heads, and each rank holds whole experts of every
    mixture-of-experts layer (expert parallelism over the tensor ranks, as vLLM's
    ``--enable-expert-parallel``): a token's experts run on the ranks that hold them and
    the layer's one all-reduce sums their outputs. A mixture-of-experts model only."""

    def sampling_rank(self, world_size: int) -> int:
        """The rank that holds the logits and samples (and holds a draft model,
        :mod:`shardline.runner.draft_model`): a pipeline's last, the others' first."""
        return world_size - 1 if self is Sharding.PIPELINE else 0


class Quantize(str, Enum):
    """How weights a file holds in 16 or 32 bits are quantized on load
    (:mod:`shardline.models.quantize`)."""

    INT8 = "int8"
    INT4 = "int4"

    @property
    def bytes_per_weight(self) -> float:
        """Bytes a weight takes once held (:mod:`shardline.models.linear`): int8 as two int4
        planes (10 bits), int4 as one (5 bits), each with a 16-bit scale and zero per 32."""
        return 1.25 if self is Quantize.INT8 else 0.625

    @property
    def vocab(self) -> "Quantize":
        """How the embedding and LM head are quantized: int8 at least, as llama.cpp's
        4-bit mixes keep them in more bits (SmolLM2 with a 4-bit embedding and tied head
        no longer knows the capital of France; with an int8 one it does)."""
        return Quantize.INT8
