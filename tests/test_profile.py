"""Host and link profiling (shardline.node.profile): a real child process, links over ASGI."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys

import httpx
import pytest
from fastapi import FastAPI

from shardline.api.internal.link_probe import router as link_routes
from shardline.cli import device_name
from shardline.devices import pick_device
from shardline.node.link_probe import LINK_HISTORY, LinkMeter, link_due, measure_link, steady_link
from shardline.node.profile import HostProfile, measure_host, measure_host_async
from shardline.parallel.compute_slots import host_id


@pytest.fixture(scope="module")
def host() -> HostProfile:
    """One measurement (a child that imports torch, ~2.5 s here) shared by the tests."""
    return measure_host(seconds=0.3, threads=1, samples=3)


def test_measure_host_positive(host):
    assert host.note == "", host.note
    assert host.total_bytes > 0 and 0 < host.available_bytes <= host.total_bytes
    assert host.cpu_count >= 1
    assert host.matmul_flops > 1e8  # any CPU does 0.1 GFLOP/s
    assert host.memory_bandwidth_bytes_per_s > 1e8
    assert host.measure_s > 0 and host.measured_at > 0
    assert (host.threads, host.samples) == (1, 3)
    assert host.host_id == host_id() and len(host.host_id) == 16  # the child's machine is ours
    assert 1e-6 < host.host_layer_s < 0.1  # the CPU probe's, on any node
    if host.accelerator == "cpu":  # a decode step's fixed cost and the int4 product's rate
        assert host.decode_layer_s == host.host_layer_s
        assert host.decode_weight_bytes_per_s > 1e7
    # No GPU for torch here: a CPU-only torch build, or no NVIDIA driver (torch is not
    # imported in this process to find out; that takes seconds).
    cuda = "+cpu" not in importlib.metadata.version("torch") and os.path.exists("/dev/nvidiactl")
    if host.accelerator == "cpu":
        assert host.accelerator_total_bytes == host.accelerator_free_bytes == 0
        assert host.matmul_dtype in ("bfloat16", "float32")
    else:  # a machine with a GPU
        assert host.accelerator == "mps" or host.accelerator.startswith("cuda:")
        assert 0 < host.accelerator_free_bytes <= host.accelerator_total_bytes
    if not cuda and sys.platform != "darwin":
        assert host.accelerator == "cpu"


def test_profile_json_round_trip(host):
    text = json.dumps(host.to_dict())
    assert HostProfile.from_dict(json.loads(text)) == host
    # Other node versions: unknown keys ignored, missing keys defaulted.
    older = HostProfile.from_dict({"total_bytes": 5, "future_field": 1})
    assert older.total_bytes == 5 and older.matmul_flops == 0.0 and older.note == ""


def test_failures_give_zeros_and_a_note():
    async def run():
        return await asyncio.gather(
            measure_host_async(device="bogus"),  # rejected before torch is imported
            measure_host_async(device="cuda:7", seconds=0.1),  # torch: no such device
            measure_host_async(seconds=0.1, timeout_s=0.05),  # killed
        )

    bogus, cuda, slow = asyncio.run(run())
    assert "unknown device" in bogus.note
    assert "CUDA" in cuda.note
    assert "timed out" in slow.note
    for profile in (bogus, cuda, slow):
        assert profile.accelerator == "unknown"
        assert profile.matmul_flops == profile.memory_bandwidth_bytes_per_s == 0.0
        assert profile.accelerator_total_bytes == profile.accelerator_free_bytes == 0
        assert profile.total_bytes > 0  # psutil's figures are still there
    assert "timed out" in measure_host(seconds=0.1, timeout_s=0.05).note


def _client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app))


def test_measure_link_over_asgi():
    app = FastAPI()
    app.include_router(link_routes())

    async def run():
        async with _client(app) as client:
            ping = (await client.get("http://peer/internal/ping")).json()
            echo = (await client.post("http://peer/internal/echo-bytes", content=b"x" * 1000)).json()
            link = await measure_link(client, "http://peer/", payload_bytes=2**20, pings=3)
        return ping, echo, link

    ping, echo, link = asyncio.run(run())
    assert ping == {"ok": True}
    assert echo == {"bytes": 1000}
    assert link["latency_s"] > 0 and link["rtt_s"] == pytest.approx(2 * link["latency_s"])
    assert link["bandwidth_bytes_per_s"] > 0
    assert link["payload_bytes"] == 2**20 and link["transfer_s"] > 0
    assert link["bandwidth_bytes_per_s"] == pytest.approx(2**20 / link["transfer_s"])


def test_measure_link_peer_without_routes_raises():
    async def run():
        async with _client(FastAPI()) as client:
            await measure_link(client, "http://peer", payload_bytes=10, pings=1)

    with pytest.raises(httpx.HTTPStatusError):
        asyncio.run(run())


def _measured(rtt_s: float, bandwidth: float) -> dict:
    return {
        "rtt_s": rtt_s,
        "latency_s": rtt_s / 2,
        "bandwidth_bytes_per_s": bandwidth,
        "payload_bytes": 1,
        "transfer_s": 1 / bandwidth,
    }


@pytest.mark.parametrize(
    "history, rtt_s, bandwidth",
    [
        ([_measured(1e-3, 1e8)], 1e-3, 1e8),
        # pings queued behind another upload on a slow link: the least round trip stays
        ([_measured(1e-3, 1e8), _measured(0.21, 2.5e5)], 1e-3, 2.5e5),
        # the least of the last LINK_HISTORY only: an older one is forgotten
        ([_measured(1e-4, 1e8)] + [_measured(2e-3, 1e8)] * LINK_HISTORY, 2e-3, 1e8),
    ],
)
def test_a_link_is_its_least_round_trip_of_late_and_its_newest_bandwidth(history, rtt_s, bandwidth):
    link = steady_link(history)
    assert link["rtt_s"] == rtt_s and link["latency_s"] == rtt_s / 2
    assert link["bandwidth_bytes_per_s"] == bandwidth


@pytest.mark.fast
@pytest.mark.parametrize(
    "now, last_at, samples, due",
    [
        (100.0, None, 0, True),
        (104.0, 100.0, 1, False),
        (105.0, 100.0, 1, True),
        (105.0, 100.0, LINK_HISTORY, False),
        (160.0, 100.0, LINK_HISTORY, True),
    ],
)
def test_a_link_is_measured_every_few_seconds_until_it_has_a_history(now, last_at, samples, due):
    """A first measurement taken while the cluster starts is busy (trial 8: 12-21 ms
    against 1.2-2 ms idle); LINK_HISTORY of them 5 s apart, then a minute apart."""
    assert link_due(now, last_at, samples) is due


@pytest.mark.fast
def test_a_link_meter_measures_a_link_once_at_a_time_and_keeps_its_least_round_trip():
    started, results = [], [_measured(0.02, 1e8), _measured(0.0015, 1e8)]

    async def measure(address: str) -> dict:
        started.append(address)
        await asyncio.sleep(0)
        return results[len(started) - 1]

    async def scenario() -> dict:
        meter = LinkMeter(measure)
        assert meter.claim("b", 0.0)
        task = asyncio.create_task(meter.measure("b", "host:1"))
        await asyncio.sleep(0)
        assert not meter.claim("b", 10.0)  # still measuring
        await task
        assert meter.claim("b", 10.0)
        await meter.measure("b", "host:1")
        return meter.links["b"]

    link = asyncio.run(scenario())
    assert started == ["host:1", "host:1"] and link["rtt_s"] == 0.0015


def test_node_side_does_not_import_torch():
    """The node process (its HTTP app, the profile and link probe) never imports torch:
    only its runners and the profile's child do."""
    code = (
        "import sys, shardline.api.app, shardline.node.profile, shardline.node.link_probe, "
        "shardline.api.internal.link_probe as p; "
        "from fastapi import FastAPI; FastAPI().include_router(p.router()); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


class FakeTorch:
    """What :func:`pick_device` reads of torch, for a machine with ``gpus`` CUDA devices."""

    def __init__(self, gpus: int) -> None:
        import torch

        self.device = torch.device
        self.cuda = type(
            "cuda",
            (),
            {
                "is_available": staticmethod(lambda: gpus > 0),
                "current_device": staticmethod(lambda: 0),
                "device_count": staticmethod(lambda: gpus),
            },
        )
        self.backends = type("backends", (), {})


@pytest.mark.fast
@pytest.mark.parametrize(
    "asked, gpus, device",
    [
        ("auto", 0, "cpu"),
        ("auto", 2, "cuda:0"),  # the first GPU torch sees
        ("cpu", 2, "cpu"),
        ("cuda", 1, "cuda:0"),
        ("cuda:1", 2, "cuda:1"),
        ("cuda", 0, RuntimeError),  # asked for, not there: the runner fails with the reason
        ("cuda:2", 2, RuntimeError),
        ("mps", 0, RuntimeError),
    ],
)
def test_a_node_s_device_is_what_its_runners_compute_on(asked, gpus, device):
    if device is RuntimeError:
        with pytest.raises(RuntimeError):
            pick_device(FakeTorch(gpus), asked)
    else:
        assert str(pick_device(FakeTorch(gpus), asked)) == device


@pytest.mark.fast
@pytest.mark.parametrize(
    "text, ok",
    [
        ("auto", True),
        ("cpu", True),
        ("cuda", True),
        ("cuda:3", True),
        ("mps", True),
        ("gpu", False),
        ("cuda:", False),
        ("CUDA", False),
    ],
)
def test_device_names_are_checked_on_the_command_line(text, ok):
    import argparse

    if ok:
        assert device_name(text) == text
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="not a device"):
            device_name(text)


@pytest.mark.timeout(120)
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA GPU")
def test_a_device_torch_cannot_use_is_refused_before_any_node_starts(capsys):
    """Trial 8: --device cuda on a machine without a GPU started the nodes, placed the
    model and ended in a runner's traceback; now the command refuses at once."""
    from shardline.cli import main
    from shardline.node.profile import device_problem

    assert device_problem("cpu") is None and device_problem("auto") is None
    assert device_problem("cuda:1") == "CUDA is not available to torch"
    assert main(["cluster", "--device", "cuda", "--port", "1"]) == 2
    assert capsys.readouterr().err == "shardline cluster: --device cuda: CUDA is not available to torch\n"
