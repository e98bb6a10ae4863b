"""The model's linear layers, with a quantized weight copy for decode on CPU.

Decode multiplies a few rows (one per running sequence) by each weight matrix, so it is
bound by the bytes of weight read per token. On CPU, oneDNN's bf16 GEMM is slow for so few
rows; torch's weight-only kernels read fewer bytes and run much faster there:

- int8: ``torch._weight_int8pack_mm``, symmetric, one scale per output channel;
- int4: ``torch._weight_int4pack_mm_for_cpu``, asymmetric, a scale and zero per group of
  32 inputs (``w = (q - 8) * scale + zero``, q in 0..15), the layout torchao and gpt-fast
  use. A GGUF Q4_0/Q4_1 block maps onto it directly (Q4_1: ``w = d * q + m``).

Measured on the 2-core development machine for SmolLM2-135M's 30 layers of one-row decode
GEMMs, weights streamed from memory: int8 11.5 ms, int4 4.4 ms.
Prefill (many rows) keeps the bf16 GEMM, which uses AVX-512 BF16 / AMX.

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
        decode_bits: 0 (no quantized copy), 8 or 4.
        packed: the quantized copy: int8 ``[out, in]``, or int4 packed by
            ``torch._convert_weight_to_int4pack_for_cpu``.
        scales: int8: ``[out]``; int4: ``[in / 32, out, 2]`` (scale, zero), compute dtype.
        decode_max_rows: inputs with at most this many rows use the quantized copy.
        partial: the output is one tensor-parallel rank's partial sum: computed and
            returned in float32, so that the all-reduced sum rounds to the compute dtype
            once, like the one-rank output (rounding each partial first made SmolLM2's
            2-rank logits differ from 1 rank's by up to 1.3 and change greedy tokens).
    """

    INT4_GROUP = 32

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 partial: bool = False) -> None:
        super().__init__()
        self.partial = partial
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.decode_bits = 0
        self.packed: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.decode_max_rows = 0

    def add_decode_copy(self, bits: int, max_rows: int) -> None:
        """Quantize the weight for inputs of at most ``max_rows`` rows (CPU, bf16/float32).

        ``bits`` 4 needs ``in_features`` divisible by 32 and ``out_features`` by 16 (the
        packing kernel's tiles) and falls back to 8 otherwise.
        Costs one byte (int8) or about 5/8 byte (int4) per weight element.
        """
        w = self.weight.detach().float()
        if bits == 4 and w.shape[1] % self.INT4_GROUP == 0 and w.shape[0] % 16 == 0:
            groups = w.view(w.shape[0], -1, self.INT4_GROUP)  # [out, in/32, 32]
            low = groups.amin(dim=2)
            scale = ((groups.amax(dim=2) - low) / 15).clamp(min=1e-12)
            q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
            q = q.view_as(w).to(torch.int32)
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
            zero = low + 8 * scale
            self.scales = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
            self.scales = self.scales.to(self.weight.dtype)
            self.decode_bits = 4
        else:
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            self.packed = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.scales = scale.to(self.weight.dtype)
            self.decode_bits = 8
        self.decode_max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, in_features]`` in the compute dtype; returns ``[rows,
        out_features]`` in the compute dtype (float32 when ``partial``)."""
        if self.partial:
            x = x.float()
        if self.decode_bits and x.shape[0] <= self.decode_max_rows:
            scales = self.scales.float() if self.partial else self.scales
            if self.decode_bits == 4:
                y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.INT4_GROUP, scales)
            else:
                y = torch._weight_int8pack_mm(x.contiguous(), self.packed, scales)
            return y if self.bias is None else y + self.bias
        if self.partial:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x, self.weight.float(), bias)
        return F.linear(x, self.weight, self.bias)


def weight_bytes(module: nn.Module) -> int:
    """Bytes the module's weights take in memory: parameters (shared ones once, also when
    two parameters hold the same memory, as a tied embedding and LM head do) and the
    quantized decode copies."""
    params = {(p.data_ptr(), p.numel()): p for p in module.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    for layer in module.modules():
        if isinstance(layer, Linear) and layer.packed is not None:
            for t in (layer.packed, layer.scales):
                total += t.numel() * t.element_size()
    return total
