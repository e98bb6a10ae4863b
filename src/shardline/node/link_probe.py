"""How fast the link to a peer node is: two small HTTP routes every node serves, ``GET
/internal/ping`` and ``POST /internal/echo-bytes`` (:mod:`shardline.api.internal.link_probe`),
and a client that times them (:func:`measure_link`) over the node's own connection pool,
so the pings also open the connection the transfers then use.

Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shardline.node.peer_error import PeerError

log = logging.getLogger(__name__)

UPLOAD_PATH = "/internal/echo-bytes"
"""The route the probe uploads its payload to: bytes the receiver discards (not JSON, and
not hashed for the signature: see ``shardline.node.signing.UNHASHED_PATHS``)."""


async def measure_link(
    client: Any,
    base_url: str,
    payload_bytes: int = 4 * 2**20,
    pings: int = 5,
    *,
    transfers: int = 2,
    timeout_s: float = 30.0,
) -> dict:
    """Measure the link to a peer node over ``client`` (an ``httpx.AsyncClient``).

    Args:
        client: the node's HTTP client (its connection pool is reused, so the pings also
            open the connection the transfers then use).
        base_url: the peer, e.g. ``"http://10.0.0.2:52415"`` (no trailing slash needed).
        payload_bytes: bytes of body each ``POST /internal/echo-bytes`` sends.
        pings: ``GET /internal/ping`` requests timed (one extra untimed first).
        transfers: POSTs timed; the fastest counts.
        timeout_s: per request.

    Returns:
        ``{"latency_s": float, "rtt_s": float, "bandwidth_bytes_per_s": float,
        "payload_bytes": int, "transfer_s": float}``:

        - ``rtt_s``: the least round-trip time of the pings (request sent to response
          read, including the peer's HTTP handling), seconds: a busy peer or other
          traffic only adds to a ping, as other work only adds to the profile's timed
          loops (a fresh-user trial saw the median read 21-39 ms on loopback while the
          nodes of a restarted cluster loaded, against 2.5-3 ms settled, and the
          preview's 3-node prediction fall from 36.5 to 8.3 tokens/s).
        - ``latency_s``: one-way latency, taken as ``rtt_s / 2``, seconds.
        - ``transfer_s``: the fastest POST of ``payload_bytes`` (upload, the peer's
          ``{"bytes": n}`` reply included), seconds.
        - ``bandwidth_bytes_per_s``: ``payload_bytes / transfer_s``, bytes/s, this node
          to the peer. Not corrected for the round trip inside ``transfer_s``: with the
          default 4 MiB that is small next to the transfer on LANs.

    Raises:
        httpx.HTTPError: the peer did not answer, or answered with an error status.
        ValueError: the peer reported receiving a different number of bytes.
    """
    base = base_url.rstrip("/")
    ping_url, echo_url = f"{base}/internal/ping", f"{base}{UPLOAD_PATH}"

    async def ping() -> float:
        start = time.perf_counter()
        response = await client.get(ping_url, timeout=timeout_s)
        response.raise_for_status()
        response.read()
        return time.perf_counter() - start

    await ping()  # connection set-up is not latency
    rtt = min([await ping() for _ in range(max(pings, 1))])

    payload = bytes(payload_bytes)
    best = float("inf")
    for _ in range(max(transfers, 1)):
        start = time.perf_counter()
        response = await client.post(
            echo_url, content=payload, timeout=timeout_s, headers={"content-type": "application/octet-stream"}
        )
        response.raise_for_status()
        received = int(response.json()["bytes"])
        best = min(best, time.perf_counter() - start)
        if received != payload_bytes:
            raise ValueError(f"{echo_url} received {received} bytes of {payload_bytes}")
    return {
        "latency_s": rtt / 2,
        "rtt_s": rtt,
        "bandwidth_bytes_per_s": payload_bytes / best if best > 0 else 0.0,
        "payload_bytes": payload_bytes,
        "transfer_s": best,
    }


LINK_HISTORY = 5
"""Measurements of a link :func:`steady_link` reads (one a minute once there are as many:
the last 5 minutes)."""


def steady_link(history: list[dict]) -> dict:
    """What a link is, from its last :data:`LINK_HISTORY` :func:`measure_link` results
    (oldest first, at least one): the newest, with the least round-trip time of them all.
    A ping only waits longer behind other traffic (another node's upload on a slow link:
    trial 5 saw 210 ms where the 2 Mbit/s link's own was ~1 ms, and the preview predicted
    5.7 tokens/s for a placement that did 25.8), never less, so the least one is the
    link's; the bandwidth is the newest (a link that became slower is slower).

    Raises:
        ValueError: an empty history.
    """
    if not history:
        raise ValueError("a link's history holds no measurement")
    rtt = min(h["rtt_s"] for h in history[-LINK_HISTORY:])
    return {**history[-1], "rtt_s": rtt, "latency_s": rtt / 2}


LINK_INTERVAL_S = 60.0
"""Seconds between measurements of the link to one peer, once it has :data:`LINK_HISTORY`."""

LINK_FIRST_INTERVAL_S = 5.0
"""Seconds between its first :data:`LINK_HISTORY` measurements: a node's first is taken
while the cluster starts (runners importing and loading on the same cores), when a
loopback round trip took 12-21 ms against 1.2-2 ms idle, and the preview predicted a
tensor instance at 0.3 tokens/s where it served 6.4 (trial 8); a minute later the least of
a few is an idle moment's."""


def link_due(now: float, last_at: float | None, samples: int) -> bool:
    """Whether a link measured last at ``last_at`` (seconds since the epoch; None: never),
    with ``samples`` measurements in its history, is due to be measured at ``now``."""
    if last_at is None:
        return True
    return now - last_at >= (LINK_FIRST_INTERVAL_S if samples < LINK_HISTORY else LINK_INTERVAL_S)


class LinkMeter:
    """The links from a node to its peers: each measured by ``measure(address)`` (a
    :func:`measure_link` result) when :func:`link_due`, and what it is taken to be
    (:func:`steady_link` of its history) in ``links`` (node id -> that dict)."""

    def __init__(self, measure: Callable[[str], Awaitable[dict]]) -> None:
        self._measure = measure
        self.links: dict[str, dict] = {}
        self._measured_at: dict[str, float] = {}
        self._history: dict[str, list[dict]] = {}
        self._measuring: set[str] = set()  # one measurement of a link at a time

    def claim(self, node_id: str, now: float) -> bool:
        """Whether the link to ``node_id`` is due to be measured at ``now`` (seconds since
        the epoch) and not being measured; True marks it measured then, so the caller
        measures it once."""
        if node_id in self._measuring or not link_due(
            now, self._measured_at.get(node_id), len(self._history.get(node_id, []))
        ):
            return False
        self._measured_at[node_id] = now
        return True

    async def measure(self, node_id: str, address: str) -> None:
        """Measure the link to ``node_id`` at ``address`` (``host:port``); a failure is
        logged and leaves ``links`` as it was."""
        self._measuring.add(node_id)
        try:
            history = self._history.setdefault(node_id, [])
            history[:] = [*history, await self._measure(address)][-LINK_HISTORY:]
            self.links[node_id] = steady_link(history)
        except PeerError as exc:
            log.warning("could not measure the link to %s: %s", node_id, exc)
        finally:
            self._measuring.discard(node_id)
