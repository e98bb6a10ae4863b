"""Finding the other nodes of a cluster on the LAN by mDNS / DNS-SD (RFC 6762, RFC 6763).

Each node registers the service ``<node id>._shardline._tcp.local.`` with its HTTP address
and port. It browses for the same service type and hands the address of every node found
to its membership loop, whose signed polls (``shardline.node.signing``) tell members from
nodes of other clusters on the LAN: those answer 401 and are left out. Nothing derived from
the cluster key is advertised (a fingerprint would let anyone on the LAN test guesses of
the key offline). Uses the zeroconf library.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Callable

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

log = logging.getLogger(__name__)

SERVICE_TYPE = "_shardline._tcp.local."


class Discovery:
    """Advertise this node and report the ``host:port`` of each shardline node found.

    Args:
        node_id: this node's id (its service instance name).
        host: the IPv4 address other nodes reach this node at; the service is advertised
            on the interface that holds it (loopback for tests on one machine).
        port: its HTTP port.
        on_peer: called with ``"host:port"`` (from zeroconf's thread) for each peer found.

    Raises (from :meth:`start`): OSError when no multicast socket can be opened;
    ValueError when ``host`` is not an IPv4 address.
    """

    def __init__(self, node_id: str, host: str, port: int, on_peer: Callable[[str], None]) -> None:
        self.node_id = node_id
        self.host = host
        self.port = port
        self.on_peer = on_peer
        self.zeroconf: Zeroconf | None = None
        self.browser: ServiceBrowser | None = None
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{node_id}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(host)],
            port=port,
            properties={"node_id": node_id},
        )

    def start(self) -> None:
        # On the interface that holds the advertised address (a node started with a LAN
        # address failed to start here: zeroconf takes no None for "all interfaces").
        ipaddress.IPv4Address(self.host)  # an address, not a name: ValueError otherwise
        self.zeroconf = Zeroconf(interfaces=[self.host], ip_version=IPVersion.V4Only)
        self.zeroconf.register_service(self.info)
        self.browser = ServiceBrowser(self.zeroconf, SERVICE_TYPE, handlers=[self._changed])

    def _changed(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed or name == self.info.name:
            return
        info = zeroconf.get_service_info(service_type, name, timeout=3000)
        if info is None or not info.parsed_addresses(IPVersion.V4Only):
            return
        self.on_peer(f"{info.parsed_addresses(IPVersion.V4Only)[0]}:{info.port}")

    def stop(self) -> None:
        if self.zeroconf is not None:
            self.zeroconf.unregister_service(self.info)
            self.zeroconf.close()
            self.zeroconf = None
