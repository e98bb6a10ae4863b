"""How a runner joins its instance's process group with every socket on the node's own
address.

torch.distributed's ``tcp://`` rendezvous makes rank 0's TCPStore listen on every
interface (``::``, measured: a node on 127.0.0.1 had its store reachable from the LAN, and
the store takes any key write without credentials). Here rank 0 binds the store's socket
itself, to ``master_addr`` (its node's ``--host``), and hands it to the store
(``TCPStore(master_listen_fd=...)``); the other ranks connect as clients. Gloo's sockets
bind to the node's own address too (``ProcessGroupGloo.create_device(hostname=...)``),
not to the first address of an interface, which ``GLOO_SOCKET_IFNAME`` would give (for a
node on 127.0.0.2 that is 127.0.0.1). ``GLOO_SOCKET_IFNAME`` set by the user still wins.
NCCL takes its interface from ``NCCL_SOCKET_IFNAME`` (set to the interface that holds the
node's address unless already set).

Neither the store nor gloo authenticates or encrypts anything: the data plane belongs on a
trusted link.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

log = logging.getLogger("shardline.runner")

GLOO_BACKEND = "shardline_gloo"
"""The name gloo is registered under with its device bound to one address (torch's own
``gloo`` backend takes no device options through ``init_process_group``)."""


class RendezvousError(RuntimeError):
    """The runner could not open its part of the instance's process group."""


def bare_address(address: str) -> str:
    """``address`` without the brackets of an IPv6 literal in ``host:port`` form
    (``[fd00::2]`` -> ``fd00::2``); other addresses and names unchanged.

    Raises:
        RendezvousError: an empty address.
    """
    bare = address[1:-1] if address.startswith("[") and address.endswith("]") else address
    if not bare:
        raise RendezvousError("no address to bind the process group to")
    return bare


@dataclass(frozen=True)
class GlooPlan:
    """Where gloo's sockets go.

    Attributes:
        hostname: bind gloo's device to this address (the node's own); None: torch's
            ``gloo`` backend with its own choice (``GLOO_SOCKET_IFNAME``'s interfaces if
            set, else the address the machine's hostname resolves to).
        reason: why, for the log.
    """

    hostname: str | None
    reason: str


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP address, bracketed or not, or a name) is this machine's
    loopback: 127.0.0.0/8, ::1 or ``localhost``."""
    bare = address[1:-1] if address.startswith("[") and address.endswith("]") else address
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def gloo_plan(host: str | None, master_addr: str, env: Mapping[str, str]) -> GlooPlan:
    """Where gloo binds for a rank of a node at ``host`` (its ``--host``, None when
    unknown) whose rank 0 is at ``master_addr``, with environment ``env``: the user's
    ``GLOO_SOCKET_IFNAME`` first, else ``host`` exactly, else a loopback ``master_addr``
    (every rank is on this machine then), else the backend's default."""
    ifname = env.get("GLOO_SOCKET_IFNAME", "").strip()
    if ifname:
        return GlooPlan(None, f"GLOO_SOCKET_IFNAME={ifname} (set in the environment)")
    if host:
        return GlooPlan(bare_address(host), "the node's address")
    if is_loopback(master_addr):
        return GlooPlan(bare_address(master_addr), "rank 0's loopback address")
    return GlooPlan(None, "no node address: the backend's default")


def bind_failure(address: str, port: int, error: OSError) -> str:
    """The ``Failed`` text for rank 0 unable to listen on ``address:port`` (``error`` from
    bind): names the two usual causes, a port taken since the coordinator chose it and an
    address that is not this machine's."""
    reason = error.strerror or str(error)
    return (
        f"cannot listen on {address}:{port} for the instance's process group ({reason}): "
        f"the port was taken since it was chosen, or {address} is not an address of this "
        f"machine (--host must be one); the instance is placed again on another port"
    )


def listen(address: str, port: int) -> socket.socket:
    """A TCP socket listening on ``address:port`` only (an IP address or a name that
    resolves to one of this machine's).

    Raises:
        RendezvousError: the address does not resolve, or bind/listen failed (the port is
            taken, the address is not this machine's); the text says which.
    """
    try:
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise RendezvousError(f"cannot resolve {address} for the instance's process group: {exc}") from exc
    try:
        return socket.create_server((address, port), family=family)
    except OSError as exc:
        raise RendezvousError(bind_failure(address, port, exc)) from exc


def _register_gloo(hostname: str) -> None:
    """Register :data:`GLOO_BACKEND`: torch's gloo with its one device bound to
    ``hostname`` (once per process; gloo raises "Cannot resolve X to a (local) address"
    for an address this machine does not hold)."""
    import torch.distributed as dist

    if GLOO_BACKEND in dist.Backend.backend_list:
        return
    gloo = dist.ProcessGroupGloo

    def create(store, rank: int, size: int, timeout: timedelta):
        options = gloo._Options()  # type: ignore[attr-defined]  # bound in C++, not in the stubs
        try:
            options._devices = [gloo.create_device(hostname=hostname)]
        except RuntimeError as exc:
            raise RendezvousError(
                f"gloo cannot bind to {hostname} ({exc}): --host must be an address of this machine"
            ) from exc
        options._timeout = timeout
        options._threads = 2  # what torch's gloo gives one device
        group = gloo(store, rank, size, options)
        group._set_sequence_number_for_group()  # as torch does for its own gloo
        return group

    dist.Backend.register_backend(GLOO_BACKEND, create, devices=["cpu"])


def _use_nccl_interface_of(host: str | None) -> None:
    """Make NCCL open its sockets on the network interface that holds ``host``
    (``NCCL_SOCKET_IFNAME``, unless already set); left to itself it picks an interface
    by its own rules, which need not be the one the other nodes reach this node on."""
    if not host:
        return
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == bare_address(host) for a in addresses):
            os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
            return
    log.warning("no network interface holds %s: NCCL uses its default interface", host)


def join(
    rank: int, world_size: int, master_addr: str, master_port: int, host: str | None, cuda: bool, timeout: timedelta
) -> None:
    """Join the default process group: gloo on CPU, NCCL on CUDA (the CUDA device already
    set). Rank 0 listens on ``master_addr:master_port`` only; every rank connects there.

    Raises:
        RendezvousError: rank 0 cannot listen there, or gloo cannot bind to ``host``.
        torch.distributed.DistError: a rank did not reach the store within ``timeout``.
    """
    import torch.distributed as dist

    address = bare_address(master_addr)
    if rank == 0:
        listener = listen(address, master_port)
        store = dist.TCPStore(address, master_port, world_size, True, timeout, master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(address, master_port, world_size, False, timeout)
    if cuda:
        _use_nccl_interface_of(host)
        backend = "nccl"
    else:
        plan = gloo_plan(host, master_addr, os.environ)
        backend = "gloo"
        if plan.hostname is not None:
            _register_gloo(plan.hostname)
            backend = GLOO_BACKEND
        log.info("gloo binds to %s", plan.hostname or plan.reason)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def ranks_share_a_gpu(profiles: list[dict]) -> bool:
    """Whether two ranks of an instance would compute on one GPU: their nodes' profiles
    (``shardline.node.profile.HostProfile``, one per rank) name the same machine
    (``host_id``) and the same CUDA device (``accelerator``, ``"cuda:N name"``). NCCL
    refuses such ranks ("Duplicate GPU detected", seen on an H200), so theirs go over
    gloo through host memory instead (``RunnerSpec.collectives_on_cpu``)."""
    seen = set()
    for profile in profiles:
        accelerator = str(profile.get("accelerator", ""))
        if not accelerator.startswith("cuda") or not profile.get("host_id"):
            continue
        key = (profile["host_id"], accelerator.split()[0])
        if key in seen:
            return True
        seen.add(key)
    return False
