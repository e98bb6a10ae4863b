"""Runner process entry: ``python -m shardline.runner FD``.

FD is this process's end of a socket pair with its node. The runner receives a RunnerSpec, joins the instance's process group
(gloo on CPU, NCCL on CUDA), loads only its shard, and runs the engine loop. Any error is
reported to the node as ``Failed`` and the process exits non-zero; if the node goes away
the runner exits.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import re
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

# Imported here, before any thread starts: a first import inside the heartbeat thread raced
# the main thread's imports ("partially initialized module 'typing'") and killed the thread,
# so the node's watchdog then killed a healthy runner.
from shardline.parallel.progress import Progress
from shardline.process_memory import memory_now
from shardline.runner.protocol import Failed, Heartbeat, Loaded, RunnerSpec, Shutdown
from shardline.runner.rendezvous import join

log = logging.getLogger("shardline.runner")

LOAD_THREADS = 1
"""torch threads while a rank loads its shard (``RunnerSpec.threads`` serve)."""


def _read_inbox(conn, inbox: "queue.Queue[object]") -> None:
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        # The node is gone: nothing can reach this runner's clients any more.
        inbox.put(Shutdown())
        os._exit(3)


class Outbox:
    """Thread-safe sending to the node; a daemon thread sends a Heartbeat every second
    (from :meth:`start_beating`).

    The same thread is the engine's progress watchdog once :meth:`watch` is called: a rank
    that stays inside a step without progress for longer than the timeout (a peer that
    stopped, a collective that never completes) reports ``Failed`` and exits, which fails
    the instance; torch.distributed's own timeout is only the backstop.
    """

    def __init__(self, conn) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.progress: Progress | None = None
        self.progress_timeout_s = 0.0

    def start_beating(self) -> None:
        """Start the heartbeat thread (once the runner has its spec: a pre-started runner
        waits for one silently)."""
        threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()

    def watch(self, progress: Progress, timeout_s: float) -> None:
        self.progress_timeout_s = timeout_s
        self.progress = progress

    def send(self, message: object) -> None:
        with self.lock:
            self.conn.send(message)

    def _beat(self) -> None:
        while True:
            try:
                self.send(Heartbeat(*memory_now()))
                progress = self.progress
                if progress is not None and progress.stalled_for() > self.progress_timeout_s:
                    error = (
                        f"no progress for {progress.stalled_for():.0f} s while "
                        f"{progress.doing} (progress timeout {self.progress_timeout_s:g} s)"
                    )
                    log.error("%s", error)
                    self.send(Failed(error))
                    os._exit(4)
            except OSError:
                return
            time.sleep(min(1.0, max(self.progress_timeout_s / 4, 0.1)))


def decode_threads(world_size: int, shard, threads: int):
    """The thread governor of a runner's decode steps
    (:class:`~shardline.runner.threads.ThreadGovernor`): on a one-rank instance whose
    decode steps run the fused decode layers (whose products give the same bits at any
    thread count) with more than one thread; else None. A rank of several would time its
    steps with the other ranks' waits in them."""
    from shardline.runner.threads import ThreadGovernor

    if world_size != 1 or shard.fused is None or threads < 2:
        return None
    return ThreadGovernor(threads)


def lends_threads(world_size: int, stage) -> bool:
    """Whether a rank's prefill steps take the threads of the compute slots its machine's
    other stages leave free (:class:`~shardline.parallel.pipeline.PipelineStage`): a CPU
    pipeline stage of several (one rank alone has its thread governor's count)."""
    return world_size > 1 and getattr(stage, "slots", None) is not None


def load_stage(spec: RunnerSpec, source, group, progress: Progress, dtype, device, comm_device, threads: int):
    """Load this rank's shard and KV cache as the stage its instance's sharding needs
    (``comm_device``: where tensors travel between ranks: a pipeline's hidden states, a
    tensor instance's sums, a ring's key and value blocks; ``threads``: the rank's serving
    threads, which size a CPU pipeline stage's share of the machine's compute slots).

    Raises:
        WeightFormatError: a tensor the shard needs is missing or has the wrong shape.
        ValueError: an unknown sharding.
    """
    from shardline.models.config import Quantize, Sharding
    from shardline.models.kv_cache import KVCache, cache_slots
    from shardline.models.shard_loader import load_shard
    from shardline.parallel.compute_slots import ComputeSlots
    from shardline.parallel.pipeline import PipelineStage
    from shardline.parallel.ring import RingStage
    from shardline.parallel.tensor import load_tensor_stage

    quantize = Quantize(spec.quantize) if spec.quantize else None
    if spec.sharding in (Sharding.TENSOR, Sharding.EXPERT):
        return load_tensor_stage(
            source,
            spec.rank,
            spec.world_size,
            slots=cache_slots(spec.max_batch, device),
            context=spec.context,
            dtype=dtype,
            device=device,
            share=spec.share.tensor_share,
            group=group,
            progress=progress,
            quantize=quantize,
            wire_device=comm_device,
        )
    if spec.sharding not in (Sharding.PIPELINE, Sharding.RING):
        raise ValueError(f"unknown sharding {spec.sharding!r}")
    shard = load_shard(
        source, spec.share.layer_start, spec.share.layer_end, dtype=dtype, device=device, quantize=quantize
    )
    cache = KVCache(source.config, len(shard.layers), cache_slots(spec.max_batch, device), spec.context, dtype, device)
    if spec.sharding == Sharding.RING:
        return RingStage(shard, cache, spec.rank, spec.world_size, group, progress, wire_device=comm_device)
    slots = None
    if device.type == "cpu":
        try:
            slots = ComputeSlots.on_this_machine(threads)
        except OSError as exc:  # a temp dir it cannot write: computes whenever it can
            log.warning("no compute slots (%s): this stage computes beside the machine's others", exc)
    return PipelineStage(shard, cache, spec.rank, spec.world_size, progress, wire_device=comm_device, slots=slots)


class DraftModelLoadError(RuntimeError):
    """The instance's draft model could not be loaded (its error names it: a rank's
    failure is reported by its text)."""


def load_draft_model(spec: RunnerSpec, dtype, device, vocab: int):
    """The instance's draft model (``spec.draft_model_path``, every layer, quantized on
    load as the instance asks, its CUDA decode graphs warmed) with a KV cache of the
    engine's slots and context (:class:`~shardline.runner.draft_model.DraftModel`;
    ``vocab``: the target's vocabulary size).

    Raises:
        DraftModelLoadError: its files are not a model the runner can load (a tensor
            missing or misshapen, an unknown architecture, a file it cannot read).
    """
    from shardline.models.config import Quantize
    from shardline.models.kv_cache import KVCache, cache_slots
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights
    from shardline.runner.draft_model import DraftModel

    assert spec.draft_model_path is not None
    try:
        source = open_weights(spec.draft_model_path)
        layers = source.config.num_layers
        quantize = Quantize(spec.quantize) if spec.quantize else None
        shard = load_shard(source, 0, layers, dtype=dtype, device=device, quantize=quantize)
    except (OSError, ValueError) as exc:  # a WeightFormatError or UnsupportedModelError among them
        raise DraftModelLoadError(f"the draft model {spec.draft_model_path}: {type(exc).__name__}: {exc}") from exc
    cache = KVCache(source.config, layers, cache_slots(spec.max_batch, device), spec.context, dtype, device)
    if shard.graphs is not None:  # its decode steps' CUDA graphs, captured now rather than while serving
        shard.graphs.warm(cache, spec.max_batch)
    return DraftModel(shard, cache, spec.prefill_chunk, vocab)


def serve(conn, outbox: Outbox, started: float) -> None:
    """Import what a rank needs, then wait for the node's RunnerSpec (a runner may be
    started ahead of its placement: ``Worker``'s pre-started runner), join the process
    group, load the shard, report Loaded and run the engine. ``started``: the process's
    start (``time.monotonic()``), for the log line that times the phases."""
    # Imported before the spec comes (the log line times the imports apart), here or in
    # the helpers that use them (_load_shard, _engine).
    import gguf  # noqa: F401 (open_weights' reader; with yaml ~0.14 s)
    import torch
    import torch.distributed as dist

    import shardline.models.shard_loader  # noqa: F401 (load_stage's)
    import shardline.parallel.pipeline  # noqa: F401
    import shardline.runner.constraint  # noqa: F401
    import shardline.runner.engine  # noqa: F401
    from shardline.devices import pick_device
    from shardline.models import linear, native_dequant, weights  # noqa: F401

    imported = time.monotonic()
    try:
        spec: RunnerSpec = conn.recv()
    except EOFError:  # a pre-started runner whose node stopped before giving it a shard
        return
    given = time.monotonic()
    outbox.start_beating()
    serving_threads = spec.threads or torch.get_num_threads()
    # Loading is thousands of small torch ops per shard: one thread. With two, SmolLM2's
    # load took 3-4x the CPU (4-7 s against 1.1-1.5 s) and 3x the time on a busy 2-core
    # machine, OpenMP's workers spinning between ops. The compiled passes over every
    # weight (unpacking, packing) take the serving threads but one, which the node keeps
    # busy during a load (its tokenizer, the placement): on 2 cores with the node busy,
    # two threads made SmolLM2's load 1.4-2.3 s where one took 0.9-1.0 (a thread waits at
    # each pass's end for the other to get its core back).
    torch.set_num_threads(LOAD_THREADS)
    device = pick_device(torch, spec.device)
    dtype = getattr(torch, spec.dtype)
    inbox: queue.Queue[object] = queue.Queue()
    threading.Thread(target=_read_inbox, args=(conn, inbox), daemon=True).start()
    group, comm_device = _join_group(spec, device)
    joined = time.monotonic()
    stage, draft = _load_shard(spec, outbox, group, dtype, device, comm_device, serving_threads)
    log.info(
        "rank %d of %s loaded on %s in %.2f s from its spec (imports %.2f s%s, process group %.2f s, shard %.2f s)",
        spec.rank,
        spec.instance_id,
        device,
        time.monotonic() - given,
        imported - started,
        ", done before the spec" if given - imported > 0.05 else "",
        joined - given,
        time.monotonic() - joined,
    )
    _engine(spec, stage, draft, inbox, outbox, group, comm_device, serving_threads).run()
    if group is not None:
        dist.destroy_process_group()


def _join_group(spec: RunnerSpec, device):
    """Join the instance's process group where it has more than one rank (NCCL on a CUDA
    device unless the spec keeps collectives on the CPU, else gloo); make ``device`` the
    current CUDA device. Returns (the group or None, the device tensors travel between
    ranks on)."""
    import torch
    import torch.distributed as dist

    group = None
    comm_device = torch.device("cpu")
    nccl = device.type == "cuda" and not spec.collectives_on_cpu
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if spec.world_size > 1:
        if nccl:
            comm_device = device
        join(
            spec.rank,
            spec.world_size,
            spec.master_addr,
            spec.master_port,
            spec.host,
            cuda=nccl,
            timeout=timedelta(seconds=spec.collective_timeout_s),
        )
        group = dist.group.WORLD
    return group, comm_device


def _load_shard(spec: RunnerSpec, outbox: Outbox, group, dtype, device, comm_device, serving_threads: int):
    """Load this rank's stage (:func:`load_stage`) and, where it samples, the instance's
    draft model (:func:`load_draft_model`), warm its decode graphs, wait for every rank to
    hold its shard, unmap the weight file and send the node :class:`Loaded`. Leaves torch
    at ``serving_threads`` threads. Returns the stage and the draft model (or None)."""
    import torch
    import torch.distributed as dist

    from shardline.models import native_dequant
    from shardline.models.linear import weight_bytes
    from shardline.models.weights import open_weights
    from shardline.process_memory import large_allocations_mapped, release_free_memory
    from shardline.runner.engine import pool_tokens

    runtime_rss, _ = memory_now()
    source = open_weights(spec.model_path)
    progress = Progress()
    with large_allocations_mapped(), native_dequant.loading_with(serving_threads - 1):
        stage = load_stage(spec, source, group, progress, dtype, device, comm_device, serving_threads)
        vocab = stage.shard.config.vocab_size
        draft = load_draft_model(spec, dtype, device, vocab) if spec.model_drafts and stage.samples else None
    cache = stage.cache
    param_bytes = weight_bytes(stage.shard) + (weight_bytes(draft.shard) if draft is not None else 0)
    torch.set_num_threads(serving_threads)
    if stage.shard.graphs is not None:
        warming = time.monotonic()
        captured, most = stage.shard.graphs.warm(cache, spec.max_batch)
        log.info(
            "captured %d decode graphs (1-%d rows, key spans up to %d) in %.2f s",
            captured,
            most,
            cache.k[0].shape[2],
            time.monotonic() - warming,
        )
    if group is not None:
        dist.barrier(group)  # every rank holds its shard before any serves
        outbox.watch(progress, spec.progress_timeout_s)
    layers = sorted(
        {int(m.group(1)) for name in source.tensors_read if (m := re.match(r"(?:blk|model\.layers)\.(\d+)\.", name))}
    )
    # Unmap the weight file: every weight is held in its resident form now, and the
    # file's pages would otherwise count in this process's memory.
    tensors_read, bytes_read = len(source.tensors_read), source.bytes_read
    del source
    gc.collect()
    release_free_memory()
    pool = pool_tokens(spec.kv_tokens, spec.max_batch, spec.context, cache.block_tokens)
    pool_bytes = pool * (cache.bytes_per_token + (draft.cache.bytes_per_token if draft is not None else 0))
    outbox.send(
        Loaded(
            tuple(layers),
            tensors_read,
            bytes_read,
            param_bytes,
            pool_bytes,
            *memory_now(),
            runtime_rss,
            device=str(device),
        )
    )
    return stage, draft


def _engine(
    spec: RunnerSpec, stage, draft, inbox: queue.Queue[object], outbox: Outbox, group, comm_device, serving_threads: int
):
    """The rank's :class:`~shardline.runner.engine.Engine` over its loaded ``stage`` (and
    ``draft``: the draft model where this rank holds one)."""
    from shardline.runner.constraint import GrammarTokenizer
    from shardline.runner.engine import Engine
    from shardline.runner.other_load import OtherLoad, RunnerAndNode
    from shardline.runner.speculation import default_drafts

    governor = decode_threads(spec.world_size, stage.shard, serving_threads)
    return Engine(
        stage,
        inbox,
        send=outbox.send,
        node_id=spec.node_id,
        group=group,
        max_batch=spec.max_batch,
        context=spec.context,
        prefill_chunk=spec.prefill_chunk,
        prefill_step_tokens=spec.prefill_step_tokens,
        prefill_burst_tokens=spec.prefill_burst_tokens,
        comm_device=comm_device,
        kv_tokens=spec.kv_tokens,
        on_idle=_release_idle_memory,
        grammar_tokenizer=GrammarTokenizer(spec.model_path),
        prefix_cache=spec.prefix_cache,
        draft_tokens=default_drafts(stage.shard.config.is_moe, spec.model_drafts),
        model_drafts=spec.model_drafts,
        draft_model=draft,
        threads=governor,
        other_load=OtherLoad(own=RunnerAndNode())
        if governor is not None or lends_threads(spec.world_size, stage)
        else None,
    )


def _release_idle_memory() -> None:
    """An idle rank's memory back to its weights and runtime: the prefill scratch and the
    activations' freed heap go back to the system (the next prefill faults them in again
    once, a few milliseconds a MiB)."""
    from shardline.models.weight_products import release_scratch
    from shardline.process_memory import release_free_memory

    release_scratch()
    release_free_memory()


def _peer_lost(exc: BaseException) -> bool:
    """Whether a collective failed because a peer rank's connection went away."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text
        for marker in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout")
    )


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s runner %(message)s")
    started = time.monotonic()
    conn = Connection(int(sys.argv[1]))
    outbox = Outbox(conn)
    try:
        serve(conn, outbox, started)
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then exits
        peer_lost = _peer_lost(exc)
        if peer_lost:
            # Another rank stopped (its instance deleted, the cluster stopping, a runner or
            # node gone): this rank stops too, and says nothing. A crash is the
            # coordinator's to report (``instance ... failed``), under the failed rank's
            # name; gloo's text here would only alarm.
            message = "lost contact with another rank of the instance"
            log.debug("rank stopped: %s: %s", message, str(exc).splitlines()[0])
        else:
            traceback.print_exc()
            message = f"{type(exc).__name__}: {exc}"
        try:
            outbox.send(Failed(message, peer_lost=peer_lost))
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
