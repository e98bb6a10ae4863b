"""Where a runner's process group binds (shardline.runner.rendezvous): the decisions as
tables, and rank 0's listening socket on 127.0.0.1 (milliseconds each)."""

from __future__ import annotations

import errno
import socket

import psutil
import pytest

from shardline.runner.rendezvous import (
    GlooPlan,
    RendezvousError,
    bare_address,
    bind_failure,
    gloo_plan,
    is_loopback,
    listen,
    ranks_share_a_gpu,
)

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]


@pytest.mark.parametrize(
    "host,master,env,hostname",
    [
        ("127.0.0.1", "127.0.0.1", {}, "127.0.0.1"),
        ("192.168.1.20", "192.168.1.10", {}, "192.168.1.20"),  # a rank's own node, not rank 0's
        ("[fd00::2]", "[fd00::1]", {}, "fd00::2"),
        ("10.0.0.5", "10.0.0.5", {"GLOO_SOCKET_IFNAME": "eth1"}, None),  # the user's override
        ("10.0.0.5", "10.0.0.5", {"GLOO_SOCKET_IFNAME": "  "}, "10.0.0.5"),  # blank: not set
        ("10.0.0.5", "10.0.0.5", {"NCCL_SOCKET_IFNAME": "eth1"}, "10.0.0.5"),
        (None, "127.0.0.1", {}, "127.0.0.1"),  # no node address, all ranks on this machine
        (None, "127.0.0.2", {}, "127.0.0.2"),
        (None, "localhost", {}, "localhost"),
        (None, "192.168.1.10", {}, None),  # rank 0 elsewhere: nothing to go by
        ("", "192.168.1.10", {}, None),
    ],
)
def test_gloo_binds_to_the_node_address_unless_the_user_names_an_interface(host, master, env, hostname):
    plan = gloo_plan(host, master, env)
    assert isinstance(plan, GlooPlan) and plan.hostname == hostname and plan.reason


@pytest.mark.parametrize(
    "address,loopback",
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("192.168.1.10", False),
        ("0.0.0.0", False),
        ("::", False),
        ("fd00::2", False),
        ("mybox.local", False),
    ],
)
def test_loopback_addresses(address, loopback):
    assert is_loopback(address) is loopback


@pytest.mark.parametrize(
    "address,bare",
    [("127.0.0.1", "127.0.0.1"), ("[fd00::2]", "fd00::2"), ("fd00::2", "fd00::2"), ("mybox.local", "mybox.local")],
)
def test_bare_address(address, bare):
    assert bare_address(address) == bare


@pytest.mark.parametrize("address", ["", "[]"])
def test_no_address_is_an_error(address):
    with pytest.raises(RendezvousError, match="no address"):
        bare_address(address)


def test_bind_failure_names_the_address_port_and_both_causes():
    text = bind_failure("127.0.0.1", 29500, OSError(errno.EADDRINUSE, "Address already in use"))
    assert "127.0.0.1:29500" in text and "Address already in use" in text
    assert "taken" in text and "not an address of this machine" in text


def test_listen_binds_the_address_only():
    with listen("127.0.0.1", 0) as server:
        host, port = server.getsockname()[:2]
        assert host == "127.0.0.1" and port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass


def test_listen_on_a_taken_port_is_a_clear_error():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"cannot listen on 127.0.0.1:{port} .*in use"):
            listen("127.0.0.1", port)


def test_listen_on_an_address_of_another_machine_is_a_clear_error():
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): no machine's own address, unless it is here.
    if any(a.address == "192.0.2.77" for addrs in psutil.net_if_addrs().values() for a in addrs):
        pytest.skip("this machine holds 192.0.2.77")
    with pytest.raises(RendezvousError, match="192.0.2.77:.*not an address of this machine"):
        listen("192.0.2.77", 0)


H200 = "cuda:0 NVIDIA H200"


@pytest.mark.parametrize(
    "profiles, shared",
    [
        ([{"host_id": "m1", "accelerator": H200}, {"host_id": "m1", "accelerator": H200}], True),
        ([{"host_id": "m1", "accelerator": H200}, {"host_id": "m2", "accelerator": H200}], False),  # two machines
        ([{"host_id": "m1", "accelerator": H200}, {"host_id": "m1", "accelerator": "cuda:1 NVIDIA H200"}], False),
        ([{"host_id": "m1", "accelerator": "cpu"}, {"host_id": "m1", "accelerator": "cpu"}], False),  # gloo anyway
        ([{"host_id": "m1", "accelerator": H200}, {}], False),  # a node not measured yet
        ([{"accelerator": H200}, {"accelerator": H200}], False),  # no machine id: not known to share
        (
            [
                {"host_id": "m1", "accelerator": H200},
                {"host_id": "m2", "accelerator": H200},
                {"host_id": "m1", "accelerator": H200},
            ],
            True,
        ),
    ],
)
def test_ranks_on_one_gpu_are_found_from_their_nodes_profiles(profiles, shared):
    assert ranks_share_a_gpu(profiles) is shared
