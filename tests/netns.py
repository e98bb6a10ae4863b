"""Hosts with their own network stacks for the tests: Linux network namespaces joined by a
bridge, each with its own address, set up and torn down with iproute2 (root only).

``Hosts(n)`` makes namespaces ``sl<tag>h<i>``, each with ``eth0`` at ``10.<a>.<b>.<i+1>/24``
on a bridge in the test's own namespace (which gets ``.254``, so the test reaches every
host), a route for multicast (mDNS) and loopback up. A host's link can be cut and restored
(:meth:`Hosts.link`) or rate-limited with a token bucket (:meth:`Hosts.limit`, ``tc ...
tbf``; delay emulation, netem, is not available on these machines).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid


def unavailable() -> str | None:
    """Why these hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"slprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """``n`` hosts on one bridge; a context manager that removes them on exit."""

    def __init__(self, n: int) -> None:
        self.tag = uuid.uuid4().hex[:6]
        octets = int(self.tag, 16)
        self.subnet = f"10.{100 + octets % 100}.{(octets >> 8) % 250}"
        self.bridge = f"slbr{self.tag}"
        self.names = [f"sl{self.tag}h{i}" for i in range(n)]
        self.addresses = [f"{self.subnet}.{i + 1}" for i in range(n)]

    def __enter__(self) -> "Hosts":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (ns, address) in enumerate(zip(self.names, self.addresses)):
                outer = f"slv{self.tag}{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``i``'s namespace."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def link(self, i: int, up: bool) -> None:
        """Cut (``up=False``) or restore host ``i``'s link to the bridge."""
        _ip("link", "set", f"slv{self.tag}{i}", "up" if up else "down")

    def limit(self, i: int, rate: str) -> None:
        """Host ``i`` sends at most ``rate`` (a tc rate, e.g. ``"20mbit"``): a token bucket
        on its ``eth0``."""
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.names[i],
                "tc",
                "qdisc",
                "add",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "32kb",
                "latency",
                "400ms",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
