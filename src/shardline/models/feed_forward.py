"""A decoder layer's feed-forward block: the dense SwiGLU MLP, or a mixture of experts.

- :class:`MLP`: SwiGLU (Shazeer, 2020, "GLU Variants Improve Transformer"),
  ``down(silu(gate(x)) * up(x))``, gate and up fused in one product.
- :class:`MixtureOfExperts`: a router and ``num_experts`` SwiGLU experts, of which each
  token uses ``num_experts_per_tok`` (Shazeer et al., 2017, "Outrageously Large Neural
  Networks: The Sparsely-Gated Mixture-of-Experts Layer"; Mixtral: Jiang et al., 2024,
  "Mixtral of Experts"). The routing is the one of transformers' ``MixtralTopKRouter``
  and ``Qwen3MoeTopKRouter`` (the oracles of the tests): softmax over every expert's router
  logit in float32, the top k, divided by their sum where ``norm_topk_prob``; gpt-oss's
  ``GptOssTopKRouter`` (a softmax over the top k logits, a router bias) gives the same
  weights.

Under tensor parallelism (a :class:`~shardline.models.config.TensorShare`) both hold only
the share's intermediate columns: of the MLP, and of every expert (each rank holds a slice
of each expert, as exo splits experts), so the layer's output is a partial sum that one
all-reduce completes, as for a dense layer. Under expert sharding (the share's
``experts``) a rank holds whole experts instead, runs those of them its rows chose, and its
output is again a partial sum: the all-reduce brings each row the outputs of its experts
from the ranks that hold them. The router is on every rank: the hidden states
it reads are the same on every rank, so every rank routes a token to the same experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardline.models.config import ModelConfig, TensorShare
from shardline.models.linear import Linear
from shardline.models.weight_products import computed_as


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection.

    Args:
        config: the model's shape (``hidden_size``; ``intermediate_size`` columns) and
            activation: SwiGLU, or where ``swiglu_limit`` > 0 gpt-oss's clamped one
            (:class:`~shardline.models.config.ModelConfig`).
        share: under tensor parallelism, the rank's columns: ``gate_up`` then holds
            ``[2 * columns, hidden]`` (gate rows, then up rows), ``down`` ``[hidden,
            columns]``, and the output is this rank's float32 partial sum.
        biases: gate_up and down have biases (gpt-oss's experts); under tensor parallelism
            only rank 0's down adds its bias, so the all-reduced sum holds it once.

    ``forward`` takes ``[N, hidden_size]`` in the compute dtype and returns ``[N,
    hidden_size]`` in the compute dtype (float32 with a ``share``).
    """

    def __init__(self, config: ModelConfig, share: TensorShare | None = None, biases: bool = False) -> None:
        super().__init__()
        inter = share.num_columns if share else config.intermediate_size
        self.gate_up = Linear(config.hidden_size, 2 * inter, bias=biases)
        self.down = Linear(
            inter, config.hidden_size, partial=share is not None, bias=biases and (share is None or share.rank == 0)
        )
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        if self.limit:  # gpt-oss (transformers' GptOssExperts._apply_gate)
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return self.down((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
        return self.down(F.silu(gate) * up)


class MixtureOfExperts(nn.Module):
    """A sparse MoE block: route each row to its top-k experts, sum their SwiGLU outputs
    weighted by the router's probabilities.

    Attributes:
        router: float32 ``[num_experts, hidden_size]``: the router (gate) weights, the
            file's values held exactly (every type a file holds a router in, F32, F16,
            BF16 or a dequantized 8-bit type, is a float32 value). The router logits are
            computed in float64 and rounded to float32 (as llama.cpp computes them in
            float32, not in the compute dtype): a float32 GEMM sums in an order that
            depends on its number of rows (one row differs from two), a float64 one
            rounded to float32 does not, so a row is routed the same whatever rows are
            beside it.
        router_bias: float64 ``[num_experts]`` (gpt-oss) or None.
        experts: ``num_experts`` :class:`MLP` (each of the share's columns only), or
            under expert sharding the share's whole experts, from expert ``first`` on.

    ``forward`` takes ``[N, hidden_size]`` in the compute dtype and returns ``[N,
    hidden_size]`` in the compute dtype (float32 with a ``share``: a partial sum).

    Each expert that any row chose runs once, on the rows that chose it; an expert no row
    chose is not read. A row's output is its experts' outputs weighted and added in float32
    in ascending expert order, then rounded once: the same operations whatever other rows
    the step holds (each expert product is one whose rows do not depend on each other, see
    :mod:`shardline.models.linear`), so a row's tokens do not depend on its batch.
    """

    def __init__(self, config: ModelConfig, share: TensorShare | None = None) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.partial = share is not None
        self.first, last = share.expert_range(config) if share else (0, config.num_experts)
        self.router = nn.Parameter(torch.empty(config.num_experts, config.hidden_size), requires_grad=False)
        self.router_bias = (
            nn.Parameter(torch.empty(config.num_experts), requires_grad=False) if config.expert_bias else None
        )
        # Whole experts (expert sharding) are each on one rank: their own outputs and
        # biases, added once in the all-reduce; split ones are a share of every expert.
        whole = share is not None and share.experts is not None
        self.experts = nn.ModuleList(
            MLP(config, None if whole else share, biases=config.expert_bias) for _ in range(self.first, last)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts of each row and their weights: int64 ``[N, top_k]`` expert ids and
        float32 ``[N, top_k]`` weights, for hidden states ``x`` ``[N, hidden_size]``."""
        logits = F.linear(x.double(), self.router.double(), self.router_bias).float()  # [N, experts]
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat, flat_weights = chosen.flatten(), weights.flatten()  # [N * top_k]: row r's at r*top_k ..
        order = flat.argsort(stable=True)  # grouped by expert, rows ascending within each
        experts, counts = flat[order].unique_consecutive(return_counts=True)
        start = 0
        with computed_as(0):  # an expert's product as for the rows that chose it
            for expert, count in zip(experts.tolist(), counts.tolist()):
                picks = order[start : start + count]
                start += count
                if not 0 <= expert - self.first < len(self.experts):
                    continue  # another rank's (expert sharding)
                rows = picks // self.top_k
                y = self.experts[expert - self.first](x.index_select(0, rows))
                out.index_add_(0, rows, y.float() * flat_weights[picks, None])
        return out if self.partial else out.to(x.dtype)
