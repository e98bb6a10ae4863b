"""Start-up times of a local cluster: launch to first answer, and placing again to ready.

Runs ``shardline cluster --nodes N`` from one or more source trees, interleaved (A B A B
...), and prints per variant the median of each phase and the ratio to the first variant:

- ``term``, ``placed``, ``ready``: launch to the node log's "coordinator for term",
  "placed ... as instance", "instance ... is ready" (the coordinator's clock);
- ``answer``: launch to the first 200 of a chat completion (the client's clock, polling
  every 50 ms from the moment the process starts);
- ``again``: with ``--place-again``, ``--settle`` seconds after the first answer (a
  cluster that has been up a while: each node starts its next pre-started runner once idle),
  DELETE the instance, POST it again through the cluster API (as the README's "Working
  the cluster" shows) and time it to ``ready`` on every node; ``again_answer`` to the first
  answer after.

Each launch gets a fresh cluster directory (new ids, no kept instance table; ``--kept``
instead times a restart of the cluster that the previous launch of the same variant
left); the machine's caches (host profile, GGUF metadata, compiled kernels) are shared,
as on a machine that has run shardline before.

    python scripts/startup_bench.py --src base=/path/to/old/src --src new=src --nodes 1 3 --rounds 3

Figures on a shared machine drift: compare variants from one interleaved run only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
EVENTS = {"term": "coordinator for term", "placed": "as instance", "ready": "is ready:"}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_events(text: str) -> dict[str, float]:
    """The first time (epoch seconds) of each of :data:`EVENTS` in a node log."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        for name, marker in EVENTS.items():
            if name not in found and marker in line:
                found[name] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return found


def wait_answer(url: str, deadline: float) -> float:
    """Poll a chat completion every 50 ms until one answers 200; the time it did."""
    with httpx.Client(timeout=30) as client:
        while time.time() < deadline:
            try:
                if client.post(f"{url}/v1/chat/completions", json=CHAT).status_code == 200:
                    return time.time()
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer")


def place_again(url: str, nodes: int, port: int, deadline: float) -> tuple[float, float]:
    """DELETE the instance, place it again; seconds to ready on every node, to an answer."""
    instances = httpx.get(f"{url}/cluster/instances", timeout=10).json()["instances"]
    for inst in instances:
        httpx.delete(f"{url}/cluster/instances/{inst['instance_id']}", timeout=30)
    start = time.time()
    made = httpx.post(f"{url}/cluster/instances", json={"model": MODEL, "sharding": "pipeline"}, timeout=60)
    made.raise_for_status()
    instance_id = made.json()["instance_id"]
    while time.time() < deadline:
        views = [httpx.get(f"http://127.0.0.1:{port + i}/cluster/instances", timeout=10).json()["instances"]
                 for i in range(nodes)]
        if all(any(x["instance_id"] == instance_id and x["status"] == "ready" for x in v) for v in views):
            ready = time.time()
            return ready - start, wait_answer(url, deadline) - start
        time.sleep(0.05)
    raise TimeoutError("not ready again")


def launch(src: str, nodes: int, port: int, data_home: Path, log: Path, again: bool, keep: bool,
           timeout_s: float, settle_s: float = 0.0) -> dict[str, float]:
    """One launch of ``shardline cluster`` from ``src``; seconds from launch to each event."""
    cluster_dir = data_home / "shardline" / "local-cluster" / str(port)
    if not keep:
        shutil.rmtree(cluster_dir, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), XDG_DATA_HOME=str(data_home))
    env.pop("SHARDLINE_API_KEY", None)
    with open(log, "wb") as out:
        start = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "shardline.cli", "cluster", "--nodes", str(nodes),
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            times = {"answer": wait_answer(url, start + timeout_s) - start}
            if again:
                time.sleep(settle_s)
                times["again"], times["again_answer"] = place_again(url, nodes, port, start + 2 * timeout_s)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    events = log_events(log.read_text(errors="replace"))
    times.update({k: t - start for k, t in events.items()})
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", action="append", required=True, metavar="NAME=DIR",
                        help="a source tree to run (its src/ directory), as NAME=DIR; repeat for A/B")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=23400)
    parser.add_argument("--place-again", action="store_true", help="also DELETE and place again")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds between the first answer and placing again (default %(default)s)")
    parser.add_argument("--kept", action="store_true",
                        help="time a restart that finds the previous launch's kept instance")
    parser.add_argument("--data-home", default=None,
                        help="XDG_DATA_HOME for the nodes (default: the caller's; a cluster "
                             "directory per port is made and removed under it)")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    variants = [tuple(s.split("=", 1)) if "=" in s else (s, s) for s in args.src]
    data_home = Path(args.data_home or os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    logs = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    ports = {(name, n): args.port + 10 * i + 100 * j
             for i, (name, _) in enumerate(variants) for j, n in enumerate(args.nodes)}
    try:
        if args.kept:  # leave a kept instance for the first timed launch to find
            for (name, src), n in ((v, n) for v in variants for n in args.nodes):
                launch(src, n, ports[name, n], data_home, logs / "prime.log", False, False, args.timeout)
        for r in range(args.rounds):
            for n in args.nodes:
                for name, src in variants:
                    log = logs / f"{name}-{n}-{r}.log"
                    times = launch(src, n, ports[name, n], data_home, log, args.place_again, args.kept,
                                   args.timeout, args.settle)
                    results.setdefault((name, n), []).append(times)
                    print(f"round {r} nodes {n} {name}: " + "  ".join(f"{k} {v:.2f}" for k, v in sorted(times.items())),
                          flush=True)
    finally:
        for port in ports.values():
            shutil.rmtree(data_home / "shardline" / "local-cluster" / str(port), ignore_errors=True)
    print(f"\nmedians (s) over {args.rounds} interleaved rounds; load {os.getloadavg()[0]:.1f}; logs in {logs}")
    keys = ["term", "placed", "ready", "answer"] + (["again", "again_answer"] if args.place_again else [])
    print(f"{'nodes':>5} {'variant':>10} " + " ".join(f"{k:>12}" for k in keys))
    for n in args.nodes:
        first = None
        for name, _ in variants:
            runs = results[name, n]
            med = {k: statistics.median(t[k] for t in runs if k in t) if any(k in t for t in runs) else float("nan")
                   for k in keys}
            cells = []
            for k in keys:
                ratio = f" ({med[k] / first[k]:.2f}x)" if first and first[k] else ""
                cells.append(f"{med[k]:6.2f}{ratio}".rjust(12))
            print(f"{n:>5} {name:>10} " + " ".join(cells))
            first = first or med
    return 0


if __name__ == "__main__":
    sys.exit(main())
