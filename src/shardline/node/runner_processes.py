"""The runner supervisor: starts, feeds, watches and stops this node's runner processes.

Each runner is a ``python -m shardline.runner FD`` subprocess that talks to the node over
one end of a socket pair (``multiprocessing.connection.Connection`` framing), so no port is
opened and a runner's death is seen at once as end-of-file. A reader thread per runner
forwards its messages to the node's event loop.

A runner imports torch and the model code (1.5-3 s on a 2-core machine) before it reads
its spec, so the worker keeps one started ahead (``spare``): it has imported everything and
waits, silent, for the spec of the next rank placed on this node, which then skips the
imports. The ``run`` command starts the first before importing the node itself (the two
processes' imports overlap) and, after one is used, the node starts another once it has been
idle a while (``Node``: its imports would take CPU from a load or the first requests);
one that exits while waiting is replaced (not after :data:`SPARE_MAX_EARLY_EXITS` exits in
a row within :data:`SPARE_EARLY_S` of their start: a runner that cannot start is left to
the ranks' own error reports).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Callable, Mapping

from shardline.node.status import RankStatus
from shardline.process_memory import private_bytes_of
from shardline.runner.protocol import Failed, Heartbeat, Loaded, RunnerSpec

log = logging.getLogger(__name__)

SPARE_EARLY_S = 60.0
"""A pre-started runner that exits within this many seconds of its start exited early."""
SPARE_MAX_EARLY_EXITS = 3
"""After this many early exits in a row the worker stops pre-starting runners."""


RUNNER_ENVIRONMENT = {"TORCH_CPP_LOG_LEVEL": "ERROR", "RES_OPTIONS": "timeout:1 attempts:1"}
"""What a runner's environment has unless the node's sets it:

- ``TORCH_CPP_LOG_LEVEL``: torch's C++ warnings left out (a peer that went away printed
  "recvVector failed ... Connection reset by peer" and 40 stack frames on the node's
  terminal; the runner reports the failure itself).
- ``RES_OPTIONS`` (glibc's resolver, resolv.conf(5)): a DNS query waits 1 s, once, not
  5 s twice. torch's TCPStore client looks up its own address's host name when it
  connects (c10d's ``formatSockAddr``; after one failure it stops asking), so on a LAN
  whose DNS server does not answer, every rank's join to its process group waited 10 s
  (trial 5: placements ready 10 s late, 20 s when placed again); measured in a network
  namespace whose DNS server drops queries: 10.0 s, then 1.0 s. A node's ``--host`` given
  as a DNS name is looked up with the same 1 s a try.
"""


def runner_environment(env: Mapping[str, str]) -> dict[str, str]:
    """A runner's environment: the node's ``env`` over :data:`RUNNER_ENVIRONMENT` (a
    variable the user set wins). The runner binds its process group's sockets to its
    node's address itself (:mod:`shardline.runner.rendezvous`); a ``GLOO_SOCKET_IFNAME``
    in ``env`` is the user's override and passes through."""
    return {**RUNNER_ENVIRONMENT, **env}


def spawn_runner() -> tuple[subprocess.Popen, Connection]:
    """A runner process (``python -m shardline.runner FD``, in a session of its own, its
    environment :func:`runner_environment`) and the node's end of its socket pair. The
    runner exits when that end closes.

    Raises:
        OSError: the process cannot be started.
    """
    ours, theirs = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-m", "shardline.runner", str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        start_new_session=True,
        env=runner_environment(os.environ),
    )
    theirs.close()
    return process, Connection(ours.detach())


@dataclass
class Spare:
    """A runner started ahead of its rank, waiting for a spec."""

    process: subprocess.Popen
    conn: Connection
    started: float = field(default_factory=time.monotonic)


@dataclass
class RunnerHandle:
    """One runner process of this node and what it last reported."""

    spec: RunnerSpec
    process: subprocess.Popen
    conn: Connection
    status: RankStatus = RankStatus.LOADING  # loading, ready, failed or stopped
    error: str | None = None
    peer_lost: bool = False  # it failed only because another rank went away (Failed)
    loaded: Loaded | None = None
    memory: Heartbeat | None = None  # the last heartbeat: resident and peak bytes
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    last_seen: float = field(default_factory=time.monotonic)  # last message, monotonic seconds
    state_lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, error: str, peer_lost: bool = False) -> bool:
        """Mark the runner failed; False if it had already failed or been stopped."""
        with self.state_lock:
            if self.status in (RankStatus.FAILED, RankStatus.STOPPED):
                return False
            self.status, self.error, self.peer_lost = RankStatus.FAILED, error, peer_lost
            return True

    def send(self, message: object) -> bool:
        """Send a message to the runner; False when it can no longer be reached."""
        if self.status in (RankStatus.FAILED, RankStatus.STOPPED):
            return False
        try:
            with self.send_lock:
                self.conn.send(message)
            return True
        except OSError:
            return False


class Worker:
    """Starts runners and reports what they say through ``on_message(instance_id, msg)``.

    ``on_message`` is called from reader threads with Loaded, Tokens, EngineStats or
    Failed. A runner that exits without a word is reported as Failed with its exit code. A
    serving runner silent for ``watchdog_s`` seconds (runners send a Heartbeat every second
    from a thread of their own, also while computing) is killed and reported as Failed; so
    is one that has not loaded within ``startup_s`` seconds (imports and the process-group
    rendezvous can hold the interpreter for seconds on a busy machine).

    With ``spare``, one runner is kept started ahead (see the module's docstring):
    :meth:`start_spare` starts it, :meth:`start` hands it the next spec.
    """

    def __init__(
        self,
        on_message: Callable[[str, object], None],
        watchdog_s: float = 10.0,
        startup_s: float = 300.0,
        spare: bool = False,
    ) -> None:
        self.on_message = on_message
        self.watchdog_s = watchdog_s
        self.startup_s = startup_s
        self.runners: dict[str, RunnerHandle] = {}
        self._lock = threading.Lock()
        self.spare_enabled = spare
        self.spare: Spare | None = None
        self._early_exits = 0
        self._stopped = False

    def loading(self) -> bool:
        """Whether a runner of this node is loading its shard."""
        return any(h.status == RankStatus.LOADING for h in list(self.runners.values()))

    def start_spare(self, started: Spare | None = None) -> None:
        """Start a runner ahead of its rank, unless pre-starting is off, one is waiting
        already, or a runner of this node is loading (it would take that load's CPU).
        ``started``: a runner already started for this (the node's command starts the first
        before its own imports), kept instead of a new one, or else stopped."""
        with self._lock:
            if (
                not self.spare_enabled
                or self._stopped
                or self.spare is not None
                or any(h.status == RankStatus.LOADING for h in self.runners.values())
            ):
                if started is not None:
                    started.conn.close()  # the runner exits at end-of-file
                return
            spare = self.spare = started or Spare(*spawn_runner())
        threading.Thread(target=self._watch_spare, args=(spare,), daemon=True, name="spare-runner").start()

    def _watch_spare(self, spare: Spare) -> None:
        """Replace the pre-started runner if it exits while waiting for a spec."""
        code = spare.process.wait()
        with self._lock:
            if self.spare is not spare:
                return  # it became a rank (or the worker stopped)
            self.spare = None
            early = time.monotonic() - spare.started < SPARE_EARLY_S
            self._early_exits = self._early_exits + 1 if early else 0
            if self._early_exits >= SPARE_MAX_EARLY_EXITS:
                self.spare_enabled = False
        spare.conn.close()
        if not self.spare_enabled:
            log.error(
                "the pre-started runner exited with code %s, %d times in a row soon after "
                "starting: runners start when placed from now on",
                code,
                self._early_exits,
            )
            return
        log.warning("the pre-started runner exited with code %s; starting another", code)
        self.start_spare()

    def spare_bytes(self) -> int:
        """Private resident bytes of the waiting pre-started runner (0 without one)."""
        spare = self.spare
        return (private_bytes_of(spare.process.pid) or 0) if spare is not None else 0

    def start(self, spec: RunnerSpec) -> RunnerHandle:
        """Run ``spec`` on the pre-started runner, or else a new one, and return at once; it
        reports Loaded or Failed."""
        with self._lock:  # taken and registered as loading at once: no spare starts between
            spare, self.spare = self.spare, None
            if spare is not None and spare.process.poll() is None:
                process, conn = spare.process, spare.conn
            else:
                if spare is not None:
                    spare.conn.close()
                process, conn = spawn_runner()
            handle = RunnerHandle(spec=spec, process=process, conn=conn)
            old = self.runners.get(spec.instance_id)
            self.runners[spec.instance_id] = handle
        if old is not None:
            self._kill(old)
        threading.Thread(target=self._serve, args=(handle,), daemon=True, name=f"runner-{spec.rank}").start()
        threading.Thread(target=self._watch, args=(handle,), daemon=True, name=f"watchdog-{spec.rank}").start()
        return handle

    def _watch(self, handle: RunnerHandle) -> None:
        started = time.monotonic()
        while handle.status not in (RankStatus.FAILED, RankStatus.STOPPED):
            time.sleep(0.25)
            now = time.monotonic()
            if handle.status == RankStatus.READY:
                silent = now - handle.last_seen
                error = f"runner stopped responding for {silent:.0f} s (watchdog {self.watchdog_s:.0f} s)"
                late = silent > self.watchdog_s
            else:
                error = f"runner did not load within {self.startup_s:.0f} s"
                late = now - started > self.startup_s
            if late and handle.fail(error):
                self._kill(handle)
                self.on_message(handle.spec.instance_id, Failed(error))

    def _serve(self, handle: RunnerHandle) -> None:
        instance_id = handle.spec.instance_id
        try:
            handle.conn.send(handle.spec)
            while True:
                message = handle.conn.recv()
                handle.last_seen = time.monotonic()
                if isinstance(message, Heartbeat):
                    handle.memory = message
                    continue
                if isinstance(message, Loaded):
                    handle.status, handle.loaded = RankStatus.READY, message
                elif isinstance(message, Failed) and not handle.fail(message.error, message.peer_lost):
                    continue
                self.on_message(instance_id, message)
        except (EOFError, OSError) as exc:
            if handle.status not in (RankStatus.FAILED, RankStatus.STOPPED):
                code = handle.process.poll()
                if code is None:
                    try:
                        code = handle.process.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        code = None
                error = f"runner exited with code {code}" if code is not None else f"runner lost: {exc}"
                if handle.fail(error):
                    self.on_message(instance_id, Failed(error))
        finally:
            if handle.process.poll() is None and handle.status == RankStatus.FAILED:
                self._kill(handle)

    def memory(self, instance_id: str) -> dict | None:
        """The instance's runner's memory on this node: ``rss_bytes`` and
        ``peak_rss_bytes`` from its last heartbeat, ``load_peak_rss_bytes``,
        ``loaded_rss_bytes`` and ``runtime_rss_bytes`` (before any weight) from its Loaded
        report; None without a runner."""
        handle = self.runners.get(instance_id)
        if handle is None:
            return None
        beat, loaded = handle.memory, handle.loaded
        return {
            "rss_bytes": beat.rss_bytes if beat else None,
            "peak_rss_bytes": beat.peak_rss_bytes if beat else None,
            "loaded_rss_bytes": loaded.rss_bytes if loaded else None,
            "load_peak_rss_bytes": loaded.peak_rss_bytes if loaded else None,
            "runtime_rss_bytes": loaded.runtime_rss_bytes if loaded else None,
        }

    def resident_bytes(self) -> int:
        """Resident bytes of this node's live runners, as they last reported, and of the
        pre-started one (the next rank's runtime, which placement counts for that rank)."""
        return self.spare_bytes() + sum(
            h.memory.rss_bytes
            for h in list(self.runners.values())
            if h.memory is not None and h.status not in (RankStatus.FAILED, RankStatus.STOPPED)
        )

    def stop(self, instance_id: str) -> None:
        """Kill the runner of an instance (if any) and reap it."""
        with self._lock:
            handle = self.runners.pop(instance_id, None)
        if handle is not None:
            with handle.state_lock:
                handle.status = RankStatus.STOPPED
            self._kill(handle)

    def stop_all(self) -> None:
        """Kill every runner, the pre-started one too, and start no more."""
        with self._lock:
            self._stopped = True
            spare, self.spare = self.spare, None
        if spare is not None:
            spare.process.kill()
            spare.process.wait()
            spare.conn.close()
        for instance_id in list(self.runners):
            self.stop(instance_id)

    @staticmethod
    def _kill(handle: RunnerHandle) -> None:
        if handle.process.poll() is None:
            handle.process.kill()
        try:
            handle.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("runner pid %s did not exit after SIGKILL", handle.process.pid)
        handle.conn.close()
