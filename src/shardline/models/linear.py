"""The model's linear layers, with an int8 weight copy for decode on CPU.

Decode multiplies a few rows (one per running sequence) by each weight matrix, so it is
bound by the bytes of weight read per token. On CPU, oneDNN's bf16 GEMM is slow for so few
rows; torch's weight-only int8 kernel (``torch._weight_int8pack_mm``, per-output-channel
scales, as used by torchao and gpt-fast) reads half the bytes and runs about 3x faster
there. Prefill (many rows) keeps the bf16 GEMM, which uses AVX-512 BF16 / AMX.

Which kernel runs depends only on the number of rows, and both kernels compute each row
independently of the others, so a sequence's output does not depend on what else is in
its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)`` for ``x`` of shape ``[rows, in_features]``.

    Attributes:
        weight: ``[out_features, in_features]`` in the compute dtype.
        bias: ``[out_features]`` or None.
        weight_int8: int8 ``[out_features, in_features]`` or None (see :meth:`add_int8_copy`).
        scales: ``[out_features]`` in the compute dtype, with ``weight ~= weight_int8 * scales``.
        int8_max_rows: inputs with at most this many rows use the int8 copy.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_int8: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.int8_max_rows = 0

    def add_int8_copy(self, max_rows: int) -> None:
        """Quantize the weight to int8 (symmetric, per output channel) for small inputs.

        Only for CPU tensors in bfloat16 or float32 (the kernel's supported inputs).
        Costs one byte per weight element.
        """
        w = self.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.weight_int8 = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales = scales.to(self.weight.dtype)
        self.int8_max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_int8 is not None and x.shape[0] <= self.int8_max_rows:
            y = torch._weight_int8pack_mm(x.contiguous(), self.weight_int8, self.scales)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


def add_int8_decode_weights(module: nn.Module, max_rows: int) -> None:
    """Give every :class:`Linear` in ``module`` an int8 copy for inputs of <= max_rows rows."""
    for layer in module.modules():
        if isinstance(layer, Linear):
            layer.add_int8_copy(max_rows)


def weight_bytes(module: nn.Module) -> int:
    """Bytes the module's weights take in memory: parameters (shared ones once) and int8 copies."""
    params = {id(p): p for p in module.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    for layer in module.modules():
        if isinstance(layer, Linear) and layer.weight_int8 is not None:
            total += layer.weight_int8.numel() + layer.scales.numel() * layer.scales.element_size()
    return total
