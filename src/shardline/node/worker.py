"""The runner supervisor: starts, feeds, watches and stops this node's runner processes.

Each runner is a ``python -m shardline.runner FD`` subprocess that talks to the node over
one end of a socket pair (``multiprocessing.connection.Connection`` framing), so no port is
opened and a runner's death is seen at once as end-of-file. A reader thread per runner
forwards its messages to the node's event loop.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Callable

from shardline.runner.protocol import Failed, Loaded, RunnerSpec

log = logging.getLogger(__name__)


@dataclass
class RunnerHandle:
    """One runner process of this node and what it last reported."""

    spec: RunnerSpec
    process: subprocess.Popen
    conn: Connection
    status: str = "loading"  # loading | ready | failed | stopped
    error: str | None = None
    loaded: Loaded | None = None
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: object) -> bool:
        """Send a message to the runner; False when it can no longer be reached."""
        if self.status in ("failed", "stopped"):
            return False
        try:
            with self.send_lock:
                self.conn.send(message)
            return True
        except OSError:
            return False


class Worker:
    """Starts runners and reports what they say through ``on_message(instance_id, msg)``.

    ``on_message`` is called from reader threads with Loaded, Tokens or Failed; a runner
    that exits without a word is reported as Failed with its exit code.
    """

    def __init__(self, on_message: Callable[[str, object], None]) -> None:
        self.on_message = on_message
        self.runners: dict[str, RunnerHandle] = {}
        self._lock = threading.Lock()

    def start(self, spec: RunnerSpec) -> RunnerHandle:
        """Spawn a runner for ``spec`` and return at once; it reports Loaded or Failed."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        if spec.master_addr.startswith("127.") or spec.master_addr == "localhost":
            env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
        process = subprocess.Popen(
            [sys.executable, "-m", "shardline.runner", str(theirs.fileno())],
            env=env,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
        )
        theirs.close()
        handle = RunnerHandle(spec=spec, process=process, conn=Connection(ours.detach()))
        with self._lock:
            old = self.runners.get(spec.instance_id)
            self.runners[spec.instance_id] = handle
        if old is not None:
            self._kill(old)
        threading.Thread(
            target=self._serve, args=(handle,), daemon=True, name=f"runner-{spec.rank}"
        ).start()
        return handle

    def _serve(self, handle: RunnerHandle) -> None:
        instance_id = handle.spec.instance_id
        try:
            handle.conn.send(handle.spec)
            while True:
                message = handle.conn.recv()
                if isinstance(message, Loaded):
                    handle.status, handle.loaded = "ready", message
                elif isinstance(message, Failed):
                    handle.status, handle.error = "failed", message.error
                self.on_message(instance_id, message)
        except (EOFError, OSError) as exc:
            if handle.status not in ("failed", "stopped"):
                code = handle.process.poll()
                if code is None:
                    try:
                        code = handle.process.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        code = None
                handle.status = "failed"
                handle.error = handle.error or (
                    f"runner exited with code {code}" if code is not None else f"runner lost: {exc}"
                )
                self.on_message(instance_id, Failed(handle.error))
        finally:
            if handle.process.poll() is None and handle.status == "failed":
                self._kill(handle)

    def stop(self, instance_id: str) -> None:
        """Kill the runner of an instance (if any) and reap it."""
        with self._lock:
            handle = self.runners.pop(instance_id, None)
        if handle is not None:
            handle.status = "stopped"
            self._kill(handle)

    def stop_all(self) -> None:
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
