"""``shardline bench`` as a command: its options, checks, the servers it measures (the local
cluster it starts without ``--url``; with ``--against URL`` another OpenAI-compatible server
beside it) and the report it prints and writes. The workloads are
:mod:`shardline.bench.compare`'s, the measurements :mod:`shardline.bench.bench`'s."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import tempfile
import time

import httpx

from shardline.bench.arguments import DEFAULT_ROUNDS_AGAINST
from shardline.bench.bench import BenchError, connect_error_message, error_message
from shardline.bench.compare import OTHER, SHARDLINE, BenchConfig, Server, run_workloads
from shardline.bench.contention import busy_cores, busy_refusal
from shardline.cluster_commands import api_key_headers
from shardline.local_cluster import LocalCluster, LocalClusterError, model_dirs_for
from shardline.runner.speculation import MAX_DRAFT_TOKENS


def _fail(message: str) -> int:
    print(f"shardline bench: {message}", file=sys.stderr)
    return 1


def _check_args(args: argparse.Namespace) -> str | None:
    """Why the bench's arguments are refused (the first problem found), else None."""
    return _workload_problem(args) or _setup_problem(args)


def _workload_problem(args: argparse.Namespace) -> str | None:
    """The first problem of the arguments that shape the workloads (prompt and generated
    tokens, concurrency, runs, chat requests, turns, system tokens, context, rounds)."""
    if any(p < 1 for p in args.prompt_tokens):
        return "--prompt-tokens values must be at least 1"
    if args.gen_tokens < 2:
        return "--gen-tokens must be at least 2 (decode speed needs two tokens)"
    if any(c < 1 for c in args.concurrency):
        return "--concurrency values must be at least 1"
    for option, values in (("--prompt-tokens", args.prompt_tokens), ("--concurrency", args.concurrency)):
        if len(set(values)) < len(values):
            return f"{option} values must differ (each gives its own levels)"
    if args.runs < 0:
        return "--runs must be at least 0"
    if args.runs == 0 and not args.chat_requests and not args.turns and not args.edits:
        return "--runs 0 leaves nothing to measure: give --chat-requests, --turns or --edits"
    if args.chat_requests < 0:
        return "--chat-requests must be at least 0"
    if args.turns < 0:
        return "--turns must be at least 0"
    if args.turn_tokens < 1:
        return "--turn-tokens must be at least 1"
    if args.system_tokens < 0:
        return "--system-tokens must be at least 0"
    if args.system_tokens and not args.turns:
        return "--system-tokens needs --turns"
    if args.think_s < 0 or (args.think_s and not args.turns):
        return "--think-s must be at least 0, and needs --turns"
    if args.context is not None and (args.context < 1 or args.url is not None):
        return "--context must be at least 1, and is the local cluster's (not with --url)"
    if args.edits < 0 or args.edit_functions < 1 or not 1 <= args.speculative <= MAX_DRAFT_TOKENS:
        return f"--edits must be at least 0, --edit-functions at least 1, --speculative 1 to {MAX_DRAFT_TOKENS}"
    if args.rounds is not None and args.rounds < 1:
        return "--rounds must be at least 1"
    return None


def _setup_problem(args: argparse.Namespace) -> str | None:
    """The first problem of the arguments that set up the run (--against's options, the
    nodes, --busy, the --json file's folder)."""
    if args.against is None:
        for option in ("against_model", "against_api_key"):
            if getattr(args, option) is not None:
                return f"--{option.replace('_', '-')} needs --against URL"
    if args.nodes < 1:
        return "--nodes must be at least 1"
    if why := busy_refusal(args.busy):
        return why
    if args.json_path:
        folder = os.path.dirname(os.path.abspath(args.json_path))
        if not os.path.isdir(folder):
            return f"--json {args.json_path}: folder {folder} does not exist"
    return None


def _normal_url(url: str) -> str:
    """A server's root URL: ``http://`` when no scheme is given, without a trailing ``/`` or
    the ``/v1`` of an OpenAI client's base URL (the bench adds the API paths itself)."""
    url = url.rstrip("/").removesuffix("/v1")
    return url if "://" in url else f"http://{url}"


def _server(name: str, url: str, model: str | None, headers: dict[str, str]) -> Server:
    """The running server at ``url`` (its model: ``model``, else its first); for a shardline
    node its instance's nodes and sharding, waiting while it loads.
    ``headers``: the API key's (:func:`shardline.cluster_commands.api_key_headers`).

    Raises:
        BenchError: ``url`` cannot be reached, lists no model, or does not serve ``model``.
    """
    try:
        response = httpx.get(f"{url}/v1/models", timeout=10, headers=headers)
        if response.status_code != 200:
            raise BenchError(error_message(response, response.content))
        try:
            ids = [m["id"] for m in response.json()["data"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise BenchError(f"{url}/v1/models did not answer with a model list") from exc
        if not ids:
            raise BenchError(f"{url} serves no model yet (GET /v1/models is empty)")
        if model is None:
            model = ids[0]
        elif model not in ids:
            raise BenchError(f"{url} does not serve {model!r} (it serves: {', '.join(ids)})")
        nodes, sharding = _wait_ready(url, model, headers)
    except httpx.HTTPError as exc:
        raise BenchError(connect_error_message(url, exc)) from exc
    return Server(name, url, model, headers, nodes, sharding)


def _wait_ready(
    url: str, model: str, headers: dict[str, str], timeout_s: float = 120.0
) -> tuple[int | None, str | None]:
    """(nodes, sharding) of the model's ready shardline instance, waiting while it loads.

    shardline's ``/v1/models`` already lists a model while it is loading; its cluster API
    (``/cluster/instances``) tells when it serves. Other OpenAI servers lack that API:
    (None, None) at once.

    Raises:
        BenchError: the model is still loading after ``timeout_s`` seconds, or it failed.
    """
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            response = httpx.get(f"{url}/cluster/instances", timeout=10, headers=headers)
            instances = [i for i in response.json()["instances"] if i["model_id"] == model]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None, None
        for inst in instances:
            if inst["status"] == "ready":
                return len(inst["ranks"]), inst["sharding"]
        if not any(i["status"] == "loading" for i in instances):
            failed = [i.get("error") for i in instances if i["status"] == "failed"]
            if failed:
                raise BenchError(f"{model!r} failed on {url}: {failed[0]}")
            return None, None
        if time.monotonic() > deadline:
            raise BenchError(f"{model!r} was still loading on {url} after {timeout_s:.0f} s")
        if not said:
            _progress(f"waiting for {model} to finish loading on {url}")
            said = True
        time.sleep(0.5)


def _busy_port(base: int, count: int) -> int | None:
    """The first port in ``base .. base+count-1`` that something already listens on, else None."""
    for port in range(base, base + count):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return port
    return None


def _progress(message: str) -> None:
    print(f"shardline bench: {message}", file=sys.stderr, flush=True)


def _bench(args: argparse.Namespace, servers: list[Server]) -> int:
    rounds = args.rounds or (DEFAULT_ROUNDS_AGAINST if len(servers) == 2 else 1)
    config = BenchConfig(
        prompt_tokens=list(args.prompt_tokens),
        gen_tokens=args.gen_tokens,
        concurrency=list(args.concurrency),
        runs=args.runs,
        rounds=rounds,
        chat_requests=args.chat_requests,
        warmup=args.warmup,
        turns=args.turns,
        turn_tokens=args.turn_tokens,
        system_tokens=args.system_tokens,
        think_s=args.think_s,
        edits=args.edits,
        edit_functions=args.edit_functions,
        draft_tokens=args.speculative,
    )
    if args.busy:
        _progress(f"keeping {args.busy} core(s) busy with competing processes while the workloads run")
    with busy_cores(args.busy):
        report = asyncio.run(run_workloads(servers, config, _progress))
    report["busy_cores"] = args.busy
    from shardline.bench.report import print_comparison, print_report

    if len(servers) == 2:
        print_comparison(report)
    else:
        print_report(report)
    shardline = servers[0]
    if args.memory:
        from shardline.bench.memory import MemoryReportError, print_memory, rank_memory

        try:
            report["memory"] = rank_memory(shardline.url, shardline.model, shardline.headers)
        except MemoryReportError as exc:
            raise BenchError(f"memory report: {exc}") from exc
        print_memory(report["memory"])
    if shardline.nodes is not None:  # a shardline cluster: its placement's prediction beside
        from shardline.bench.prediction import instance_speed, one_request_decode, prediction_line

        speed = instance_speed(shardline.url, shardline.model, shardline.headers)
        line = None if speed is None else prediction_line(speed, one_request_decode(report, shardline.name))
        if line is not None:
            report["prediction"] = speed
            print(line)
    for server in report["servers"]:
        if server["usage_from"] == "chunks":
            _progress(
                f"{server['name']} ({server['url']}) sent no usage in its streams: completion tokens "
                "are its content chunks counted, prompt tokens the calibrated length"
            )
    short = [
        (w["name"], r["completion_tokens"])
        for w in report["workloads"]
        if w["kind"] == "level"
        for n in w["results"]
        for lv in w["results"][n]["rounds"]
        for r in lv["per_request"]
        if r["completion_tokens"] < args.gen_tokens
    ]
    if short:
        _progress(
            f"warning: {len(short)} request(s) generated fewer than {args.gen_tokens} tokens "
            f"(as few as {min(n for _, n in short)}): the server ignored ignore_eos or the context is full"
        )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
        _progress(f"wrote {args.json_path}")
    return 0


def main(args: argparse.Namespace) -> int:
    """Run ``shardline bench``; 0 on success, 1 with a one-line message on stderr otherwise."""
    problem = _check_args(args)
    if problem:
        return _fail(problem)
    # SIGTERM (e.g. from ``timeout``) must still stop a local cluster: its nodes run in
    # their own sessions and would outlive this process.
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        previous = None
    try:
        return _main(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _main(args: argparse.Namespace) -> int:
    cluster = None
    log_dir = None
    try:
        other = None
        if args.against is not None:  # checked first: a wrong URL fails before a cluster starts
            key = args.against_api_key
            try:
                other = _server(
                    OTHER,
                    _normal_url(args.against),
                    args.against_model,
                    {"Authorization": f"Bearer {key}"} if key else {},
                )
            except BenchError as exc:
                return _fail(f"--against: {exc}")
        if args.url is not None:
            shardline = _server(SHARDLINE, _normal_url(args.url), args.model, api_key_headers(args.api_key))
        else:
            from shardline.models.store import DEFAULT_MODEL_ID

            busy = _busy_port(args.port, args.nodes)
            if busy is not None:
                return _fail(f"port {busy} is in use; pick other ports with --port, or bench it with --url")
            log_dir = tempfile.mkdtemp(prefix="shardline-bench-")
            _progress(
                f"starting a {args.nodes}-node cluster on ports {args.port}-"
                f"{args.port + args.nodes - 1} (node logs in {log_dir})"
            )
            cluster = LocalCluster(
                nodes=args.nodes,
                base_port=args.port,
                runner_threads=args.runner_threads,
                log_dir=log_dir,
                model_dirs=model_dirs_for(args.model) + model_dirs_for(args.draft_model),
                api_key=args.api_key,
            )
            cluster.start()
            _progress(f"placing {args.model or DEFAULT_MODEL_ID} ({args.sharding})")
            cluster.clear()  # instances the bench's own nodes kept from an earlier run
            options = {} if args.context is None else {"context": args.context}
            if args.draft_model is not None:
                options["draft_model"] = args.draft_model
            instance = cluster.place(
                args.model or DEFAULT_MODEL_ID, args.sharding, prefix_cache=not args.no_prefix_cache, **options
            )
            shardline = Server(
                SHARDLINE,
                cluster.url(0),
                instance["model_id"],
                api_key_headers(args.api_key),
                len(instance["ranks"]),
                instance["sharding"],
            )
        return _bench(args, [shardline] if other is None else [shardline, other])
    except BenchError as exc:
        return _fail(str(exc))
    except httpx.HTTPError as exc:
        target = cluster.url(0) if cluster is not None else "the cluster"
        return _fail(connect_error_message(target, exc))
    except OSError as exc:  # e.g. --json PATH not writable
        return _fail(str(exc))
    except KeyboardInterrupt:
        print("shardline bench: interrupted", file=sys.stderr)
        return 130
    except LocalClusterError as exc:
        where = f" (node logs in {log_dir})" if log_dir else ""
        return _fail(f"local cluster: {exc}{where}")
    finally:
        if cluster is not None:
            _progress("stopping the local cluster")
            cluster.stop()
