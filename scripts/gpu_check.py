"""The CUDA path, checked on a machine with an NVIDIA GPU: ``python scripts/gpu_check.py
--tokenizer DIR --out DIR``.

Writes random-weight Llama models in bfloat16 safetensors (SmolLM2-135M's, Llama-3.2-1B's
and Llama-3.1-8B's shapes, with SmolLM2's 49,152-token vocabulary and the tokenizer files
in ``--tokenizer``), then:

1. the device's copy bandwidth (bytes read and written per second);
2. per model, in process on ``cuda``: prefill of 512 tokens (tokens/s) and decode steps
   of 1 and 8 sequences at context 128 and 2048 (ms a step, tokens/s, and the bytes a
   step reads, weights and KV cache, per second as a fraction of the copy bandwidth and
   of the H200's 4.8 TB/s);
3. the 135M model's logits for a 16-token prompt on CUDA (bfloat16 and float32) against
   the CPU in float32: largest difference relative to the logits' spread, and whether
   the top token agrees;
4. end to end: one node (``--device cuda``) serving the 1B model over HTTP: TTFT and
   streamed decode tokens/s of 128 tokens, the node's profile and the preview's predicted
   speed beside the measured, the API's sampling parameters and 4, 8 and 16 clients at
   once; then two nodes of the one GPU serving it as 2 ranks of a pipeline, a tensor and
   a ring instance (gloo between the ranks: NCCL refuses two ranks on one device).

``--parts`` picks some of 2, 3 and 4 (``in_process agreement end_to_end``); ``--device cpu`` is a dry run of the script where no
GPU is. Prints each figure as it is measured and writes them all to ``OUT/gpu_check.json``.
Random weights: the figures are speeds, not text; the shapes decide the time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

H200_BYTES_PER_S = 4.8e12
VOCAB = 49152
SHAPES = {  # hidden, intermediate, layers, heads, kv heads, tied embeddings
    "smollm2-135m": (576, 1536, 30, 9, 3, True),
    "llama-1b": (2048, 8192, 16, 32, 8, True),
    "llama-8b": (4096, 14336, 32, 32, 8, False),
}
RESULTS: dict = {}
PARTS = ["in_process", "agreement", "end_to_end"]
DEVICE = "cuda"  # --device cpu: a dry run of the script where no GPU is


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def note(key: str, value) -> None:
    RESULTS[key] = value
    print(f"{key}: {json.dumps(value)}", flush=True)


def write_model(name: str, directory: Path, tokenizer: Path) -> Path:
    """A random-weight Llama of shape ``SHAPES[name]`` as a safetensors folder."""
    from safetensors.torch import save_file

    hidden, inter, layers, heads, kv_heads, tied = SHAPES[name]
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": VOCAB, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "head_dim": head_dim,
    }
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": rand(VOCAB, hidden, scale=1.0),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    if not tied:
        tensors["lm_head.weight"] = rand(VOCAB, hidden, scale=hidden ** -0.5)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for part, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                           ("v_proj", kv_heads * head_dim)):
            tensors[p + f"self_attn.{part}.weight"] = rand(rows, hidden, scale=hidden ** -0.5)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim, scale=hidden ** -0.5)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, hidden, scale=hidden ** -0.5)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, hidden, scale=hidden ** -0.5)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, inter, scale=inter ** -0.5)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    for f in tokenizer.iterdir():
        shutil.copy(f, directory / f.name)
    return directory


def copy_bandwidth() -> float:
    """Bytes read and written per second by a device-to-device copy of 2 GiB."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    times = []
    for _ in range(10):
        started = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - started)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def timed_ms(call, repeat: int) -> float:
    call()
    sync()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def in_process(name: str, path: Path, bandwidth: float) -> None:
    from shardline.models.kv_cache import KVCache
    from shardline.models.linear import weight_bytes as shard_weight_bytes
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    started = time.perf_counter()
    source = open_weights(path)
    config = source.config
    shard = load_shard(source, 0, config.num_layers, dtype=torch.bfloat16, device=DEVICE)
    sync()
    weight_bytes = shard_weight_bytes(shard)
    note(f"{name}.load", {"seconds": round(time.perf_counter() - started, 2), "weight_bytes": weight_bytes,
                          "fused_decode": shard.fused is not None,
                          "decode_graphs": shard.graphs is not None})
    cache = KVCache(config, config.num_layers, 8, 2048 + 8, torch.bfloat16, device=DEVICE)
    for t in cache.k + cache.v:
        t.normal_(0, 0.5)
    prompt = torch.randint(0, VOCAB, (512,), device=DEVICE)
    ms = timed_ms(lambda: shard(prompt, shard.prefill_batch(0, 0, 512, True), cache), 5)
    note(f"{name}.prefill512", {"ms": round(ms, 2), "tokens_per_s": round(512 / ms * 1e3, 1)})
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    graphs = shard.graphs
    for path in ("graphs", "eager") if graphs is not None else ("eager",):
        shard.graphs = graphs if path == "graphs" else None
        for context in (128, 2048):
            for rows in (1, 8):
                ids = torch.randint(0, VOCAB, (rows,), device=DEVICE)
                ms = timed_ms(lambda: shard(ids, shard.decode_batch(list(range(rows)), [context] * rows), cache), 20)
                read = weight_bytes + rows * context * kv_bytes_per_token
                rate = read / (ms / 1e3)
                note(f"{name}.decode.{path}.c{context}.rows{rows}", {
                    "ms": round(ms, 3), "tokens_per_s": round(rows / ms * 1e3, 1),
                    "bytes_per_s": round(rate / 1e9, 1) * 1e9,
                    "of_copy_bandwidth": round(rate / bandwidth, 3), "of_h200_peak": round(rate / H200_BYTES_PER_S, 3)})
    shard.graphs = graphs



def agreement(path: Path) -> None:
    from shardline.models.kv_cache import KVCache
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    prompt = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(1))
    logits = {}
    for device, dtype in (("cpu", torch.float32), (DEVICE, torch.float32), (DEVICE, torch.bfloat16)):
        source = open_weights(path)
        shard = load_shard(source, 0, source.config.num_layers, dtype=dtype, device=device)
        cache = KVCache(source.config, source.config.num_layers, 1, 64, dtype, device=device)
        out = shard(prompt.to(device), shard.prefill_batch(0, 0, 16, True), cache)
        logits[f"{device}-{str(dtype).removeprefix('torch.')}"] = out[0].float().cpu()
        if shard.graphs is not None:  # a decode step replayed from a graph against eager
            graphs, steps = shard.graphs, {}
            for way in ("graphs", "eager"):
                shard.graphs = graphs if way == "graphs" else None
                kv = KVCache(source.config, source.config.num_layers, 3, 64, dtype, device=device)
                shard(prompt.to(device), shard.prefill_batch(1, 0, 16, True), kv)
                for position in range(16, 20):  # capture, then replays
                    out = shard(torch.tensor([position], device=device), shard.decode_batch([1], [position]), kv)
                steps[way] = out[0].float().cpu()
            note(f"agreement.{device}-{str(dtype).removeprefix('torch.')}.decode_graphs_vs_eager", {
                "max_abs_diff_over_std": round(float((steps["graphs"] - steps["eager"]).abs().max()
                                                     / steps["eager"].std()), 5),
                "same_top_token": bool(steps["graphs"].argmax() == steps["eager"].argmax()),
                "graphs_captured": len(graphs)})
    ref = logits.pop("cpu-float32") if DEVICE == "cuda" else logits["cpu-float32"]
    for key, value in logits.items():
        note(f"agreement.{key}_vs_cpu-float32", {
            "max_abs_diff_over_std": round(float((value - ref).abs().max() / ref.std()), 5),
            "same_top_token": bool(value.argmax() == ref.argmax())})


def stream(url: str, model_id: str, label: str, rounds: int = 3) -> None:
    """Stream 128 tokens ``rounds`` times; note TTFT and decode tokens/s of each."""
    import httpx

    for round_ in range(rounds):
        sent = time.perf_counter()
        first = None
        chunks = 0
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": model_id, "prompt": "The capital of France is", "max_tokens": 128,
                "temperature": 0, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                    chunks += 1
                    first = first or time.perf_counter()
        done = time.perf_counter()
        note(f"{label}.stream{round_}", {
            "status": response.status_code, "chunks": chunks,
            "ttft_ms": round(((first or done) - sent) * 1e3, 1),
            "decode_tokens_per_s": round((chunks - 1) / (done - first), 1) if first and chunks > 1 else None})


def concurrent(url: str, model_id: str, label: str, clients: int) -> None:
    """``clients`` streams of 128 tokens at once (prompts of different lengths, so the
    rows' key spans differ); note the aggregate decode tokens/s and whether every text is
    the one it gets alone."""
    import threading

    import httpx

    def body(i: int) -> dict:
        return {"model": model_id, "prompt": "The capital of France is" + " very" * (i * 37),
                "max_tokens": 128, "temperature": 0}

    alone = [httpx.post(f"{url}/v1/completions", json=body(i), timeout=120).json()["choices"][0]["text"]
             for i in range(2)]
    texts: list[str | None] = [None] * clients
    tokens = [0] * clients

    def one(i: int) -> None:
        reply = httpx.post(f"{url}/v1/completions", json=body(i), timeout=120).json()
        texts[i], tokens[i] = reply["choices"][0]["text"], reply["usage"]["completion_tokens"]

    started = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    note(label, {"tokens": sum(tokens), "seconds": round(wall, 2),
                 "aggregate_tokens_per_s": round(sum(tokens) / wall, 1),
                 "first_two_texts_as_alone": [texts[i] == alone[i] for i in range(2)]})


def profiled(cluster) -> bool:
    """Whether every node of ``cluster`` has measured its profile (its accelerator)."""
    nodes = cluster.http.get(f"{cluster.url(0)}/cluster/nodes", timeout=5).json()["nodes"]
    return len(nodes) == cluster.n and all((n.get("profile") or {}).get("accelerator") for n in nodes)


def end_to_end(models: Path, big: Path, log_dir: Path, work: Path) -> None:
    import httpx

    from shardline.local_cluster import LocalCluster

    cluster = LocalCluster(nodes=1, base_port=52900, log_dir=str(log_dir / "one"), runner_threads=2,
                           data_dir=str(work / "one-data"), model_dirs=[models], device=DEVICE)
    try:
        started = time.perf_counter()
        cluster.start()
        deadline = time.time() + 90  # the preview's prediction needs the measured profile
        while not profiled(cluster) and time.time() < deadline:
            time.sleep(1)
        note("e2e.one_node.profiled_s", round(time.perf_counter() - started, 1))
        inst = cluster.place(str(big), "pipeline", timeout_s=180, context=4096)
        note("e2e.one_node.placed", {"seconds_to_ready": round(time.perf_counter() - started, 1),
                                     "ranks": [r.get("loaded", {}).get("device") for r in inst["ranks"]]})
        stream(cluster.url(0), inst["model_id"], "e2e.one_node")
        node = cluster.http.get(f"{cluster.url(0)}/cluster/nodes", timeout=5).json()["nodes"][0]
        note("e2e.one_node.profile", node.get("profile"))
        speed = cluster.http.get(f"{cluster.url(0)}/cluster/instances/{inst['instance_id']}", timeout=10).json()["speed"]
        note("e2e.one_node.speed", speed)
        for clients in (4, 8, 16):
            concurrent(cluster.url(0), inst["model_id"], f"e2e.one_node.c{clients}", clients)
        for label, params in (("logit_bias", {"logit_bias": {"100": 5}}), ("logprobs", {"logprobs": 3}),
                              ("seeded", {"temperature": 0.8, "seed": 1, "top_p": 0.9, "top_k": 40}),
                              ("penalties", {"frequency_penalty": 0.5, "presence_penalty": 0.3}),
                              ("echo_logprobs", {"echo": True, "logprobs": 2}),
                              ("n2", {"n": 2, "temperature": 0.7}),
                              ("json", {"response_format": {"type": "json_object"}})):
            path = "/v1/chat/completions" if label == "json" else "/v1/completions"
            body = ({"messages": [{"role": "user", "content": "Give a JSON object."}]} if label == "json"
                    else {"prompt": "The capital of France is"})
            reply = httpx.post(f"{cluster.url(0)}{path}", timeout=120, json={
                "model": inst["model_id"], "max_tokens": 8, **body, **params})
            note(f"e2e.params.{label}", {"status": reply.status_code, "body": reply.text[:200]})
    finally:
        cluster.stop()
    cluster = LocalCluster(nodes=2, base_port=52910, log_dir=str(log_dir / "two"), runner_threads=2,
                           data_dir=str(work / "two-data"), model_dirs=[models], device=DEVICE)
    try:
        cluster.start()
        deadline = time.time() + 90
        while not profiled(cluster) and time.time() < deadline:
            time.sleep(1)
        for sharding in ("pipeline", "tensor", "ring"):
            label = f"e2e.two_ranks_one_gpu.{sharding}"
            try:
                cluster.clear()
                inst = cluster.place(str(big), sharding, timeout_s=180, context=4096)
                note(label, {"status": inst["status"], "collectives_on_cpu": inst.get("collectives_on_cpu"),
                             "ranks": [r.get("loaded", {}).get("device") for r in inst["ranks"]]})
                stream(cluster.url(0), inst["model_id"], label, rounds=2)
                if sharding == "ring":  # a prompt long enough to go round the ring (128 a rank)
                    reply = httpx.post(f"{cluster.url(0)}/v1/completions", timeout=120, json={
                        "model": inst["model_id"], "prompt": "The capital of France is" + " very" * 400,
                        "max_tokens": 8, "temperature": 0})
                    note(f"{label}.long_prompt", {"status": reply.status_code, "usage": reply.json().get("usage")})
            except Exception as exc:  # noqa: BLE001 (what it says is the finding)
                note(label, {"refused_or_failed": str(exc)[:600]})
    finally:
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_check"))
    parser.add_argument("--skip", nargs="*", default=[], help="models to leave out")
    parser.add_argument("--parts", nargs="*", default=PARTS, choices=PARTS, help="the checks to run")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    note("device", {"name": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                    "torch": torch.__version__})
    models = args.work / "models"
    steps = []
    bandwidth = copy_bandwidth() if DEVICE == "cuda" else H200_BYTES_PER_S
    note("copy_bandwidth_bytes_per_s", round(bandwidth / 1e9, 1) * 1e9)
    paths = {}
    for name in SHAPES:
        if name in args.skip:
            continue
        started = time.perf_counter()
        paths[name] = write_model(name, models / name, args.tokenizer)
        note(f"{name}.written_s", round(time.perf_counter() - started, 1))
    if "in_process" in args.parts:
        steps += [(f"in_process.{n}", lambda n=n: in_process(n, paths[n], bandwidth)) for n in paths]
    if "agreement" in args.parts:
        steps.append(("agreement", lambda: agreement(paths["smollm2-135m"])))
    big = paths.get("llama-1b", paths["smollm2-135m"])
    if "end_to_end" in args.parts:
        steps.append(("end_to_end", lambda: end_to_end(models, big, args.out, args.work)))
    for label, step in steps:
        try:
            step()
        except Exception:  # noqa: BLE001 (each step reports its own failure and the rest go on)
            note(f"{label}.error", traceback.format_exc()[-1500:])
        if DEVICE == "cuda":
            torch.cuda.empty_cache()  # the step's shard and cache, gone with its frame
        (args.out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
