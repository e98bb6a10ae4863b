"""What a runner's decode step costs on this machine, timed in the profile child
(``python -m shardline.node.profile``; torch is imported inside each function, never by
the node): :func:`runner_runtime` (a tiny model's decode step per layer),
:func:`cuda_decode_layer_s` (the same on a CUDA GPU), :func:`decode_weight_rate` (the
int4 one-row product's weight-read rate) and :func:`cuda_decode_weight_rate` (the dense
one-row product's on a CUDA GPU).

Units: seconds, bytes/s.

Each keeps the least time of its timed calls, not the median: other work on the machine
only adds to a call's time, and a node measures as it starts, beside its pre-started
runner importing torch and other local nodes starting (the median then took the int4
product's rate at 6.2 GB/s where it runs at 9.7, and the preview predicted 35% under the
measured decode). What a runner loses to its own node and clients is learnt from served
speeds (:mod:`shardline.placement.served`).
"""

from __future__ import annotations

import time

# Decode steps of the tiny runner model timed for ``decode_layer_s`` (the least is kept).
DECODE_STEPS = 15

PROBE_LAYERS = 16
"""Layers of the tiny model whose decode step gives a layer's fixed cost: the step's own
cost (embedding, head, the sampled rows) is spread over as many layers as a small model
has. Over 2 layers it counted 8x a layer, and once the fused decode layers made a layer
~20 us, SmolLM2's decode was predicted at 0.45x its measured speed."""

# The weight a one-row product is timed on for ``decode_weight_bytes_per_s``: [rows, cols]
# int4 (2.6 MB resident; quantized in ~0.3 s on a 2-core VM).
DECODE_WEIGHT_SHAPE = (2048, 2048)

DECODE_PROBE_BYTES = 256 << 20
"""Resident bytes the one-row products are timed over (copies of the weight, each read
once a pass): a model's decode step reads its weights from memory, not from cache, so the
pass must be well past the last-level cache. On a 2-vCPU Zen 4 VM with a 32 MB L3 (two
threads, in one run) 64 MB read at 26.9 GB/s and 256 MB at 23 GB/s, and with the 64 MB
figure the preview put a Qwen3-30B-A3B-shaped model's decode (229 MB a token) at 1.55x
what it did on one node and on a 3-node pipeline; at 1 thread 15.1 GB/s for one 2.6 MB
weight, 16.2 GB/s for 64 MB (separate runs)."""


def runner_runtime() -> float:
    """Run what a runner runs, on a tiny random model (:data:`PROBE_LAYERS` layers, 256 wide, int4 weights):
    its modules (the model code, the weight readers, the parallel stages), torch's int4
    layout probe, a prefill of 96 tokens (dequantized products) and decode steps (the
    fused decode layers where they run, else the layers' torch ops), so that the code
    and buffers those kernels bring count in the runtime (a runner's memory grew by
    ~30 MiB beyond a bare torch process once it served).

    Returns:
        The least of ``DECODE_STEPS`` timed decode steps (after one untimed) divided by
        the model's layers: seconds a decoder layer costs a decode step beyond reading
        its weights (``HostProfile.decode_layer_s``)."""
    import gguf  # noqa: F401, PLC0415 (the weight files' reader)
    import torch  # noqa: PLC0415

    import shardline.models.weights  # noqa: F401, PLC0415
    import shardline.parallel.pipeline  # noqa: F401, PLC0415 (only in the child)
    import shardline.parallel.ring  # noqa: F401, PLC0415
    import shardline.parallel.tensor  # noqa: F401, PLC0415
    import shardline.runner.engine  # noqa: F401, PLC0415
    from shardline.models.config import Quantize  # noqa: PLC0415
    from shardline.models.fused_decode import for_shard  # noqa: PLC0415
    from shardline.models.kv_cache import KVCache  # noqa: PLC0415
    from shardline.models.linear import resident_weight  # noqa: PLC0415
    from shardline.models.quantize import quantize_groups  # noqa: PLC0415

    dtype, generator = torch.bfloat16, torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int):
        values = torch.randn(rows, cols, generator=generator) * 0.05
        return resident_weight(quantize_groups(values, Quantize.INT4), dtype)

    shard, config = _probe_shard(weight, dtype)
    shard.fused = for_shard(shard)  # as the loader decides: a runner's decode path
    cache = KVCache(config, PROBE_LAYERS, 1, 128, dtype)
    return _decode_layer_s(shard, cache, lambda: None)


def cuda_decode_layer_s(device) -> float:
    """``HostProfile.decode_layer_s`` on a CUDA ``device`` (a ``torch.device``): the probe
    model of :func:`runner_runtime` in dense bfloat16 on the device (a runner's form of
    16-bit weights there), its decode steps replayed from CUDA graphs as a runner's are
    (:mod:`shardline.models.decode_graphs`); seconds per layer."""
    import torch  # noqa: PLC0415

    from shardline.models import decode_graphs  # noqa: PLC0415
    from shardline.models.kv_cache import KVCache  # noqa: PLC0415
    from shardline.models.linear import resident_weight  # noqa: PLC0415

    dtype, generator = torch.bfloat16, torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int):
        return resident_weight(torch.randn(rows, cols, generator=generator) * 0.05, dtype, device)

    shard, config = _probe_shard(weight, dtype)
    shard.to(device)
    shard.graphs = decode_graphs.for_shard(shard)
    cache = KVCache(config, PROBE_LAYERS, 1, 128, dtype, device)
    return _decode_layer_s(shard, cache, lambda: torch.cuda.synchronize(device))


def _probe_shard(weight, dtype):
    """The probe model (:data:`PROBE_LAYERS` layers, 256 wide, a 512-token vocabulary)
    with ``weight(rows, cols)``'s resident weights and its norms in ``dtype``; and its
    config."""
    from shardline.models.config import ModelConfig  # noqa: PLC0415
    from shardline.models.linear import Linear  # noqa: PLC0415
    from shardline.models.llama import DecoderShard  # noqa: PLC0415

    config = ModelConfig("llama", PROBE_LAYERS, 256, 512, 4, 2, 64, 512, 1e-5, 10000.0, 128, True)
    shard = DecoderShard(config, 0, PROBE_LAYERS)
    for param in shard.parameters():
        param.data = param.data.to(dtype)
    for module in shard.modules():
        if isinstance(module, Linear) and module is not shard.lm_head:
            module.set_parts([weight(module.out_features, module.in_features)])
    assert shard.embed is not None and shard.lm_head is not None  # one shard: both ends
    shard.embed.weight, shard.embed.dtype = weight(512, 256), dtype
    shard.lm_head.set_parts([shard.embed.weight])
    return shard, config


def _decode_layer_s(shard, cache, sync) -> float:
    """A prefill of 96 tokens, then the least of ``DECODE_STEPS`` timed decode steps
    (after one untimed; ``sync()`` waits for the device) divided by the layers."""
    import torch  # noqa: PLC0415

    ids = torch.randint(0, 512, (96,), generator=torch.Generator().manual_seed(0)).to(shard.device)
    times = []
    with torch.inference_mode():
        shard(ids, shard.prefill_batch(0, 0, 96, want_logits=True), cache)
        for _ in range(DECODE_STEPS + 1):
            sync()
            start = time.perf_counter()
            shard(ids[:1], shard.decode_batch([0], [96]), cache)
            sync()
            times.append(time.perf_counter() - start)
    return min(times[1:]) / len(shard.layers)


def decode_weight_rate(samples: int) -> float:
    """``HostProfile.decode_weight_bytes_per_s``: resident bytes / least seconds of
    one-row products with copies of an int4 weight of ``DECODE_WEIGHT_SHAPE`` (CPU,
    bfloat16), :data:`DECODE_PROBE_BYTES` in all, each read once a pass."""
    import copy  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from shardline.models.config import Quantize  # noqa: PLC0415
    from shardline.models.linear import Linear, resident_weight  # noqa: PLC0415
    from shardline.models.quantize import quantize_groups  # noqa: PLC0415

    rows, cols = DECODE_WEIGHT_SHAPE
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 0.05
    linear = Linear(cols, rows)
    linear.set_parts([resident_weight(quantize_groups(values, Quantize.INT4), torch.bfloat16)])
    linears = [linear] + [copy.deepcopy(linear) for _ in range(max(DECODE_PROBE_BYTES // linear.nbytes(), 1) - 1)]
    row = torch.randn(1, cols).to(torch.bfloat16)
    times = []
    with torch.inference_mode():
        for each in linears:
            each(row)
        for _ in range(max(samples, 1) * 3):
            start = time.perf_counter()
            for each in linears:
                each(row)
            times.append(time.perf_counter() - start)
    return sum(each.nbytes() for each in linears) / min(times)


CUDA_WEIGHT_SHAPE = (4096, 4096)
"""The dense bfloat16 weight a CUDA one-row product is timed on (32 MiB: a 7-8B model's
attention output projection; a 1B model's products are 8-64 MiB)."""

CUDA_PROBE_BYTES = 512 << 20
"""Bytes of weights the CUDA one-row products read a pass: well past the device's L2
cache (an H200's is 60 MiB), as a model's decode step reads its weights from HBM."""


def cuda_decode_weight_rate(device) -> float:
    """``HostProfile.decode_weight_bytes_per_s`` on a CUDA ``device`` (a ``torch.device``):
    weight bytes / least seconds of a pass of one-row products (bfloat16, one
    :data:`CUDA_WEIGHT_SHAPE` weight after another, :data:`CUDA_PROBE_BYTES` in all),
    replayed from a CUDA graph as a runner's decode products are. A matrix-vector product
    reads its weight below the copy bandwidth (an H200: the Llama-3.1-8B shape's decode
    step read 57% of it), which the preview's bandwidth alone missed."""
    import torch  # noqa: PLC0415

    from shardline.models.decode_graphs import capture  # noqa: PLC0415
    from shardline.models.linear import Linear, resident_weight  # noqa: PLC0415

    rows, cols = CUDA_WEIGHT_SHAPE
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 0.05
    linears = []
    for _ in range(max(CUDA_PROBE_BYTES // (rows * cols * 2), 1)):
        linear = Linear(cols, rows)
        linear.set_parts([resident_weight(values, torch.bfloat16, device)])
        linears.append(linear)
    row = torch.randn(1, cols).to(torch.bfloat16).to(device)

    def products() -> None:
        for each in linears:
            each(row)

    with torch.inference_mode():
        graph, _ = capture(device, products)
        times = []
        for _ in range(DECODE_STEPS + 1):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    read = sum(each.nbytes() for each in linears)
    del graph
    linears.clear()
    torch.cuda.empty_cache()  # the probe's 512 MiB back to the device before runners load
    return read / min(times[1:])


__all__ = ["cuda_decode_layer_s", "cuda_decode_weight_rate", "decode_weight_rate", "runner_runtime"]
