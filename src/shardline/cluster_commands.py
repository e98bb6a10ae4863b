"""The cluster commands of the ``shardline`` CLI: ``nodes``, ``instances``, ``place``,
``delete``, ``connect`` and ``models``.

All but ``models add`` / ``models remove`` are clients of a running node's cluster API
(``--url``, default ``$SHARDLINE_URL`` or ``http://127.0.0.1:52415``; any node answers for
the whole cluster) and print rich tables. ``models add`` and ``models remove`` change the
model store in a data directory directly, so they work with no node running; a node sees
the change at once.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

DEFAULT_PORT = 52415
"""A node's HTTP port where none is given (``shardline run``, a peer address, ``--url``)."""

if TYPE_CHECKING:
    from rich.console import Console

# httpx and rich are imported where used: every shardline process builds the CLI's parser
# (add_commands), and a node's runner starts only after it (~0.15 s of imports).


PIPE_WIDTH = 240
"""Columns of tables printed to a pipe or file without ``$COLUMNS`` (rich's default of 80
wrapped ``nodes`` cells over several lines); a terminal gets its own width."""


@functools.cache
def _console() -> Console:
    from rich.console import Console

    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=PIPE_WIDTH) if piped else Console()


def api_key_headers(api_key: str | None = None) -> dict[str, str]:
    """The header a client of a node sends its API key in: ``api_key``, else
    ``$SHARDLINE_API_KEY``; none when neither is set."""
    key = api_key or os.environ.get("SHARDLINE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


class CommandError(RuntimeError):
    """A message for the user; the command exits with status 1."""


CONNECT_TIMEOUT_S = 5.0
"""Seconds a cluster command waits to connect to the node at ``--url``."""


def _request(
    args: argparse.Namespace, method: str, path: str, body: dict | None = None, timeout_s: float = 120.0
) -> dict:
    """A cluster-API call; its JSON body.

    Raises:
        CommandError: no node answers at ``--url``, or it answered an error (its detail).
    """
    import httpx

    from shardline.api.errors import error_message

    url = args.url.rstrip("/") + path
    try:
        # a node that is up connects at once; one cut off made the command wait 71 s
        timeout = httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S)
        response = httpx.request(method, url, json=body, timeout=timeout, headers=api_key_headers(args.api_key))
    except httpx.HTTPError as exc:
        raise CommandError(
            f"no shardline node answers at {args.url} ({exc}); start one with "
            f"`shardline run`, or give --url the address of one (host:port)"
        ) from None
    try:
        data = response.json()
    except ValueError:
        data = {"detail": response.text}
    if response.status_code >= 400:
        raise CommandError(f"{response.status_code}: {error_message(data) or data}")
    return data


def _gb(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f} GB"


def serving_by_node(instances: list[dict]) -> dict[str, list[str]]:
    """The model ids each node holds a rank of (``GET /cluster/instances``' entries):
    node id -> model ids in table order, each once; failed instances left out."""
    serving: dict[str, list[str]] = {}
    for inst in instances:
        if inst["status"] == "failed":
            continue
        for rank in inst["ranks"]:
            models = serving.setdefault(rank["node_id"], [])
            if inst["model_id"] not in models:
                models.append(inst["model_id"])
    return serving


def models_held(node: dict) -> str:
    """The models a node of ``GET /cluster/nodes`` holds, for ``shardline nodes``: the
    embedded default where the node is live (its package carries it, as ``models list``
    says), then its store's, a partial copy marked "(part)"; ``-`` for none."""
    from shardline.models.store import DEFAULT_MODEL_ID

    held = [f"{DEFAULT_MODEL_ID} (embedded)"] if node.get("live") else []
    held += [
        m + ("" if v.get("complete") else " (part)")
        for m, v in (node.get("models") or {}).items()
        if m != DEFAULT_MODEL_ID
    ]
    return ", ".join(held) or "-"


def links_text(node: dict) -> str:
    """A node's measured links (``GET /cluster/nodes``' ``links``), for ``shardline
    nodes``: per peer (its id's first 4 characters) the round trip in ms and the upload
    bandwidth (MB/s, kB/s below 1 MB/s), a line each; ``-`` for none."""

    def rate(bytes_per_s: float) -> str:
        return f"{bytes_per_s / 1e6:.0f} MB/s" if bytes_per_s >= 1e6 else f"{bytes_per_s / 1e3:.0f} kB/s"

    lines = [
        f"{peer[:4]}: {link['rtt_s'] * 1e3:.1f} ms, {rate(link['bandwidth_bytes_per_s'])}"
        for peer, link in sorted((node.get("links") or {}).items())
    ]
    return "\n".join(lines) or "-"


def _nodes(args: argparse.Namespace) -> None:
    from rich.table import Table

    data = _request(args, "GET", "/cluster/nodes")
    serving = serving_by_node(_request(args, "GET", "/cluster/instances")["instances"])
    table = Table(title=f"coordinator: {data['coordinator']}")
    for column in (
        "node",
        "address",
        "live",
        "memory: free / offered, placed",
        "accelerator",
        "links (round trip, upload)",
        "serving",
        "models held",
    ):
        table.add_column(column, no_wrap=column in ("node", "address"))
    for n in sorted(data["nodes"], key=lambda n: n["node_id"]):
        profile = n.get("profile") or {}
        flops = profile.get("matmul_flops")
        accelerator = str(profile.get("accelerator") or "-")
        memory = (
            f"{_gb(n.get('free_bytes'))} / {_gb(n.get('offered_bytes'))}" if n["live"] else "- (down)"
        )  # its last report: nothing to place on
        table.add_row(
            n["node_id"],
            n["address"],
            "yes" if n["live"] else "DOWN",
            f"{memory}\n{_gb(n.get('committed_bytes'))} placed",
            accelerator + (f"\n{flops / 1e12:.2f} TFLOP/s" if flops else ""),
            links_text(n),
            ", ".join(serving.get(n["node_id"], [])) or "-",
            models_held(n),
        )
    _console().print(table)


def rank_share(rank: dict) -> str:
    """A rank's part of the model in words: its layers, or its heads and MLP columns."""
    share = rank.get("tensor_share")
    if share:
        return (
            f"heads {share['heads'][0]}-{share['heads'][1] - 1}, "
            f"columns {share['columns'][0]}-{share['columns'][1] - 1}"
        )
    return f"layers {rank['layer_start']}-{rank['layer_end'] - 1}"


def _rank_text(rank: dict) -> str:
    part = rank_share(rank)
    status = rank["status"]
    fetched = rank.get("fetched")
    if status == "fetching" and fetched:
        status += f" {100 * fetched['done_bytes'] // max(fetched['total_bytes'], 1)}%"
    return f"{rank['node_id']}: {part} ({status})"


def speed_text(predicted: float | None, measured: float | None, samples: int) -> str:
    """``predicted / measured (n)`` tokens/s for a table cell: ``-`` for a figure not
    known, ``n`` the requests the measured figure is the median of."""

    def figure(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"

    return f"{figure(predicted)} / {figure(measured)}" + (f" ({samples})" if samples else "")


def _instances(args: argparse.Namespace) -> None:
    from rich.table import Table

    data = _request(args, "GET", "/cluster/instances")
    table = Table(
        caption="measured: the median of the requests that ran alone (n of them) on this "
        "placement (model, nodes, sharding), its earlier instances too; a request "
        "that shares decode steps with others is not timed, nor prefill of a short prompt"
    )
    for column in (
        "instance",
        "model",
        "sharding",
        "dtype",
        "status",
        "ranks",
        "decode tok/s\npredicted / measured",
        "prefill tok/s\npredicted / measured",
    ):
        table.add_column(column, no_wrap=column == "instance")
    for i in data["instances"]:
        status = i["status"] + (f": {i['error']}" if i.get("error") else "")
        speed = i.get("speed") or {}
        table.add_row(
            i["instance_id"],
            i["model_id"] + (f"\ndrafted by {i['draft_model']}" if i.get("draft_model") else ""),
            i["sharding"],
            i["dtype"],
            status,
            "\n".join(_rank_text(r) for r in i["ranks"]),
            speed_text(
                speed.get("predicted_decode_tokens_per_s"),
                speed.get("measured_decode_tokens_per_s"),
                speed.get("decode_samples", 0),
            ),
            speed_text(
                speed.get("predicted_prefill_tokens_per_s"),
                speed.get("measured_prefill_tokens_per_s"),
                speed.get("prefill_samples", 0),
            ),
        )
    _console().print(table if data["instances"] else "no instances")


def _connect(args: argparse.Namespace) -> None:
    """Print the settings that point ``args.client`` at a ready model (``--model``, else the
    only one; with several, the first placed), with its context (:mod:`shardline.connect`)."""
    from shardline.connect import connection

    ready = [i for i in _request(args, "GET", "/cluster/instances")["instances"] if i["status"] == "ready"]
    if args.model is not None:
        ready = [i for i in ready if i["model_id"] == args.model]
    if not ready:
        which = f"model {args.model!r} is not" if args.model else "no model is"
        raise CommandError(f"{which} ready on the cluster: place it first (`shardline place MODEL`)")
    chosen = ready[0]
    key = args.api_key or os.environ.get("SHARDLINE_API_KEY")
    print(connection(args.client, args.url, chosen["model_id"], chosen["context"], key).text(), end="")


def node_url(text: str) -> str:
    """A node's base URL (argparse type): ``http://`` put before an address given without
    a scheme (``127.0.0.1:8000``), as curl reads it, and the default port (52415) after
    one without a port (``10.0.0.2``, as ``--peers`` reads it); an API's base path (``/v1``, what
    ``place`` prints and OpenAI clients take) and a trailing ``/`` left out.

    Raises:
        argparse.ArgumentTypeError: not an http(s) URL with a host.
    """
    import httpx

    url = text if "://" in text else f"http://{text}"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        parsed = None
    if parsed is not None and "://" not in text and parsed.port is None and parsed.host:
        # an address without a port means a node's default one, as --peers reads it
        parsed = parsed.copy_with(port=DEFAULT_PORT)
        url = str(parsed).rstrip("/")
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise argparse.ArgumentTypeError(f"{text!r} is not a node's URL (e.g. http://127.0.0.1:8000)")
    url = url.rstrip("/")
    return url.removesuffix("/v1") if parsed.path.rstrip("/") == "/v1" else url


def byte_size(text: str) -> int:
    """``8GB``, ``512MiB`` or a number of bytes, as an int (argparse type)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 8GB, 512MiB, 1000000)") from None


def _place(args: argparse.Namespace) -> None:
    from rich.table import Table

    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()] if args.nodes else None
    body = {
        "model": args.model,
        "sharding": args.sharding,
        "nodes": nodes,
        "context": args.context,
        "max_batch": args.max_batch,
        "dtype": args.dtype,
        "force": args.force,
        "min_nodes": args.min_nodes,
        "max_nodes": args.max_nodes,
        "kv_cache_bytes": args.kv_cache_bytes,
        "quantize": args.quantize,
        "prefix_cache": not args.no_prefix_cache,
        "draft_model": args.draft_model,
    }
    if args.preview:
        data = _request(args, "POST", "/cluster/placements/preview", body)
        table = Table()
        for column in ("sharding", "nodes", "decode tok/s", "prefill tok/s", "KV tokens", "refused because"):
            table.add_column(column)
        for c in data["candidates"]:
            # "measured": this placement served; "scaled": the model corrected by others'
            basis = {"measured": " (measured)", "scaled": " (scaled)"}
            table.add_row(
                c["sharding"],
                ", ".join(c["node_ids"]) + (" (serving)" if c.get("serving") else ""),
                f"{c['predicted_decode_tokens_per_s']:.1f}{basis.get(c.get('decode_basis'), '')}"
                if c["feasible"]
                else "-",
                f"{c['predicted_prefill_tokens_per_s']:.0f}{basis.get(c.get('prefill_basis'), '')}"
                if c["feasible"]
                else "-",
                f"{c['kv_tokens']:,}" if c["feasible"] else "-",
                c["error"] or "",
            )
        _console().print(table)
        if not any(c["feasible"] for c in data["candidates"]):
            raise CommandError(
                "no placement fits (the reasons are above)"
                if data["candidates"]
                else "no candidate placement for these nodes and shardings"
            )
        return
    inst = _request(args, "POST", "/cluster/instances", body)
    _console().print(f"placed {inst['model_id']} as instance {inst['instance_id']} ({inst['sharding']})")
    if args.no_wait:
        return
    deadline = time.monotonic() + args.timeout
    shown = None
    while time.monotonic() < deadline:
        try:  # the instance, or the one placed again in its place
            now = _request(args, "GET", f"/cluster/instances/{inst['instance_id']}")
        except CommandError as exc:
            raise CommandError(f"the instance is gone ({exc}; see `shardline instances`)") from None
        if now["instance_id"] != inst["instance_id"]:
            _console().print(f"instance {inst['instance_id']} failed; placed again as {now['instance_id']}")
        inst = now
        text = ", ".join(_rank_text(r) for r in inst["ranks"])
        if text != shown:
            _console().print(text)
            shown = text
        if inst["status"] == "ready":
            _console().print(f"ready: {inst['model_id']} serves at {args.url.rstrip('/')}/v1")
            return
        if inst["status"] == "failed":
            raise CommandError(f"instance {inst['instance_id']} failed: {inst['error']}")
        time.sleep(0.5)
    raise CommandError(
        f"instance {inst['instance_id']} was not ready within {args.timeout:g} s "
        f"(it goes on loading; see `shardline instances`)"
    )


def _delete(args: argparse.Namespace) -> None:
    deleted = _request(args, "DELETE", f"/cluster/instances/{args.instance_id}")["deleted"]
    _console().print(
        f"deleted {deleted}"
        if deleted == args.instance_id
        else f"deleted {deleted} (placed again in place of {args.instance_id})"
    )


def _models_list(args: argparse.Namespace) -> None:
    from rich.table import Table

    data = _request(args, "GET", "/cluster/models")
    table = Table()
    for column in ("model", "format", "size", "on nodes", "partly on", "instances"):
        table.add_column(column)
    for m in data["models"]:
        table.add_row(
            m["model_id"],
            m["format"],
            "embedded" if m["embedded"] else _gb(m["total_bytes"]),
            ", ".join(m["complete_on"]),
            ", ".join(m["partial_on"]),
            ", ".join(f"{i['instance_id']} ({i['status']})" for i in m["instances"]),
        )
    _console().print(table)


def _store(args: argparse.Namespace):
    from shardline.models.store import ModelStore
    from shardline.node.identity import default_data_dir

    return ModelStore((Path(args.data_dir) if args.data_dir else default_data_dir()) / "models")


def _models_add(args: argparse.Namespace) -> None:
    from shardline.models.config import UnsupportedModelError
    from shardline.models.store import ModelNotFoundError, ModelStoreError, looks_like_path

    store = _store(args)
    try:
        if Path(args.source).expanduser().exists() or looks_like_path(args.source):
            manifest = store.add_local(args.source, args.id)
        elif args.id is not None:
            raise CommandError(f"{args.source} does not exist (--id names a local file or directory)")
        else:
            manifest = store.add_from_hub(args.source)
    except (ModelStoreError, ModelNotFoundError, UnsupportedModelError) as exc:
        raise CommandError(str(exc)) from None
    _console().print(
        f"{manifest.model_id}: {len(manifest.files)} files, {_gb(manifest.total_bytes)} "
        f"({manifest.format}) in {store.model_dir(manifest.model_id)}"
    )


def _models_remove(args: argparse.Namespace) -> None:
    from shardline.models.store import ModelStoreError

    store = _store(args)
    if store.model_dir(args.model_id).exists() and not args.force:
        try:
            listed = _request(args, "GET", "/cluster/instances", timeout_s=5.0)["instances"]
        except CommandError:
            listed = []  # no node answers: nothing of this cluster serves it
        serving = [
            i["instance_id"]
            for i in listed
            if args.model_id in (i["model_id"], i.get("draft_model")) and i["status"] != "failed"
        ]
        if serving:
            raise CommandError(
                f"{args.model_id} is served by instance {', '.join(serving)} (as its model or its draft "
                "model: `shardline instances`); "
                f"delete it first (`shardline delete {serving[0]}`), or pass --force to remove the "
                "files anyway (a node without them cannot place the model again)"
            )
    try:
        removed = store.remove(args.model_id)
    except ModelStoreError as exc:
        raise CommandError(str(exc)) from None
    if not removed:
        raise CommandError(f"{args.model_id} is not in the model store")
    _console().print(f"removed {args.model_id}")


def _run(func):
    def run(args: argparse.Namespace) -> int:
        try:
            func(args)
        except CommandError as exc:
            print(f"shardline {args.command}: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(
                f"shardline {args.command}: interrupted (a placed instance goes on loading: see `shardline instances`)",
                file=sys.stderr,
            )
            return 130
        return 0

    return run


def add_commands(sub, default_port: int) -> None:
    """Add the cluster commands to the ``shardline`` parser's subparsers."""
    from shardline.connect import CLIENTS

    url_default = os.environ.get("SHARDLINE_URL", f"http://127.0.0.1:{default_port}")

    def client(name: str, help: str, func) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help)
        _add_url(parser, url_default)
        parser.set_defaults(func=_run(func))
        return parser

    client("nodes", "list the cluster's nodes with their memory, accelerator and speed", _nodes)
    client("instances", "list the placed models and each rank's share and status", _instances)
    place = client("place", "place a model on the cluster and wait until it serves", _place)
    _place_arguments(place)
    delete = client("delete", "delete an instance (its runners stop on every node)", _delete)
    delete.add_argument("instance_id")
    connect = client("connect", "print the settings that point a coding agent at a placed model", _connect)
    connect.add_argument("client", choices=CLIENTS, help="the agent: Claude Code, Codex, opencode, aider or llm")
    connect.add_argument("--model", default=None, help="a ready model's id (default: the one placed first)")

    _model_commands(sub, url_default)


def _add_url(parser: argparse.ArgumentParser, url_default: str) -> None:
    """A cluster client's ``--url`` (default ``url_default``) and ``--api-key``."""
    parser.add_argument(
        "--url",
        default=url_default,
        type=node_url,
        help="a node of the cluster (default: $SHARDLINE_URL or %(default)s)",
    )
    parser.add_argument(
        "--api-key", default=None, help="the cluster's API key, if it has one (default: $SHARDLINE_API_KEY)"
    )


def _place_arguments(place: argparse.ArgumentParser) -> None:
    """``shardline place``'s arguments: the model and what the placement is asked for."""
    from shardline.models.store import DEFAULT_MODEL_ID
    from shardline.placement.ranks import SHARDING_NAMES

    place.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL_ID,
        help="a model id in some node's store, a path on the node's machine under one "
        "of its --model-dir (added to its store), or a Hugging Face repo id in "
        "the local cache (default %(default)s)",
    )
    place.add_argument(
        "--sharding",
        default="auto",
        choices=("auto", *SHARDING_NAMES),
        help="default %(default)s: the placement with the best predicted tokens/s",
    )
    place.add_argument(
        "--nodes", default=None, help="node ids, comma-separated, in rank order (default: as --sharding chooses)"
    )
    place.add_argument("--min-nodes", type=int, default=None, help="without --nodes: use at least this many")
    place.add_argument("--max-nodes", type=int, default=None, help="without --nodes: use at most this many")
    place.add_argument("--context", type=int, default=None, help="tokens per sequence")
    place.add_argument("--max-batch", type=int, default=None, help="sequences decoded together")
    place.add_argument(
        "--kv-cache-bytes",
        type=byte_size,
        default=None,
        help="the KV pool, e.g. 256MB: the whole model's keys and values (a ring "
        "rank holds all of it), at most max-batch sequences of the context "
        "(default: that, or as much as fits); requests wait for its blocks",
    )
    place.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    place.add_argument(
        "--quantize",
        default=None,
        choices=("int8", "int4"),
        help="quantize the weights a model's files hold in 16 or 32 bits on load "
        "(int8: 10 bits a weight, int4: 5; quantized GGUF weights stay as "
        "they are)",
    )
    place.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="keep no finished prompt for later ones that start the same: every "
        "prompt is prefilled whole (the cache lives in the KV pool either way)",
    )
    place.add_argument(
        "--draft-model",
        default=None,
        metavar="MODEL",
        help="a model of the same tokenizer that the sampling rank holds whole and drafts with for "
        "speculative decoding: an id, or a path as MODEL takes one (default: drafts by prompt lookup)",
    )
    place.add_argument("--force", action="store_true", help="place even where the measured memory says it does not fit")
    place.add_argument(
        "--preview", action="store_true", help="list the feasible placements with predicted tokens/s instead"
    )
    place.add_argument("--no-wait", action="store_true", help="return once placed, before it loads")
    place.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default %(default)s)")


def _model_commands(sub, url_default: str) -> None:
    """``shardline models list | add | remove``."""
    models = sub.add_parser("models", help="the models of the cluster and of this machine's store")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    listing = models_sub.add_parser("list", help="every model a live node holds, and where")
    _add_url(listing, url_default)
    listing.set_defaults(func=_run(_models_list))
    add = models_sub.add_parser("add", help="add a model to this machine's store")
    add.add_argument(
        "source",
        help="a .gguf file, a Hugging Face safetensors directory, or a Hugging Face "
        "repo id (downloaded; offline, taken from the Hugging Face cache)",
    )
    add.add_argument("--id", default=None, help="the model's id (default: the file stem, directory name or repo id)")
    remove = models_sub.add_parser("remove", help="delete a model from this machine's store")
    remove.add_argument("model_id")
    _add_url(remove, url_default)
    remove.add_argument("--force", action="store_true", help="remove it even while the cluster at --url serves it")
    for parser, func in ((add, _models_add), (remove, _models_remove)):
        parser.add_argument(
            "--data-dir", default=None, help="the node's data directory (default: $XDG_DATA_HOME/shardline)"
        )
        parser.set_defaults(func=_run(func))
