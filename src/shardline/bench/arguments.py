"""The options of ``shardline bench``, apart from the command (:mod:`shardline.bench.command`),
whose imports (httpx, the local cluster) every shardline process would pay otherwise: each
builds the whole CLI parser before it starts anything."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 52600
"""First port of the local cluster ``shardline bench`` starts without ``--url``."""

DEFAULT_ROUNDS_AGAINST = 3
"""Rounds with ``--against`` (one without)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``shardline bench``'s options to its subparser."""
    _cluster_arguments(parser)
    _workload_arguments(parser)
    _edit_arguments(parser)
    _comparison_arguments(parser)


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster measured: a running one (``--url``) or a local one it starts."""
    from shardline.cluster_commands import node_url
    from shardline.models.store import DEFAULT_MODEL_ID
    from shardline.placement.ranks import SHARDING_NAMES

    parser.add_argument(
        "--url",
        default=None,
        type=node_url,
        help="benchmark this running node (http://host:port); default: start a local cluster",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="the API key of the node at --url, or the one the local cluster's nodes "
        "require (default: $SHARDLINE_API_KEY, else none)",
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the local cluster (default %(default)s)")
    parser.add_argument(
        "--sharding",
        default="pipeline",
        choices=SHARDING_NAMES,
        help="sharding of the local cluster (default %(default)s)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help=f"model id or local path (default {DEFAULT_MODEL_ID}; with --url: the node's first model)",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="first port of the local cluster (default %(default)s)"
    )
    parser.add_argument(
        "--runner-threads", type=int, default=0, help="torch threads per runner of the local cluster (0: cores / nodes)"
    )


def _workload_arguments(parser: argparse.ArgumentParser) -> None:
    """What is measured: prompt levels, concurrency, the short chat, the conversation."""
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        nargs="+",
        default=[512],
        help="prompt length in tokens, chat template included; several values give several levels (default 512)",
    )
    parser.add_argument(
        "--gen-tokens", type=int, default=128, help="tokens generated per request (default %(default)s)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1],
        help="requests in flight at once; several values give several levels (default 1)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=3,
        help="requests per level and round, at least the concurrency; 0: no levels, only the "
        "short chat and the conversation (default %(default)s)",
    )
    parser.add_argument(
        "--chat-requests",
        type=int,
        default=4,
        help="short chat questions (about 37 prompt tokens) per round, for its TTFT; 0: none (default %(default)s)",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=0,
        help="also a conversation of this many turns, one after another, each sending the "
        "whole chat so far with a new user message, then the same again with "
        "cache_prompt false (figures: the first and the last turn's TTFT, and the last "
        "turn's without the cache); 0: none (default %(default)s)",
    )
    parser.add_argument(
        "--turn-tokens",
        type=int,
        default=250,
        help="tokens of each turn's new user message, about (default %(default)s)",
    )
    parser.add_argument(
        "--system-tokens",
        type=int,
        default=0,
        help="the conversation opens with a system prompt of about this many tokens of "
        "tool definitions, as a coding agent's does (default %(default)s: none)",
    )
    parser.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="seconds the conversation waits before each turn after the first, as a person "
        "reading and typing or an agent running its tool would (default %(default)s)",
    )


def _edit_arguments(parser: argparse.ArgumentParser) -> None:
    """The code-editing workload: its requests, its file, its speculation."""
    parser.add_argument(
        "--edits",
        type=int,
        default=0,
        help="also a code-editing workload of this many requests a round: a Python file to "
        "repeat with one change, each sent without speculative decoding and again with "
        "speculative.n_max set to --speculative (figures: decode tok/s of both); 0: none "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--edit-functions",
        type=int,
        default=30,
        help="functions of the code-editing workload's file, about 40 tokens each (default %(default)s)",
    )
    parser.add_argument(
        "--speculative",
        type=int,
        default=8,
        help="speculative.n_max of the code-editing workload's speculative requests (default %(default)s)",
    )


def _comparison_arguments(parser: argparse.ArgumentParser) -> None:
    """The local instance's settings, the rounds, the other server, the report and the load."""
    from shardline.cluster_commands import node_url

    parser.add_argument(
        "--context",
        type=int,
        default=None,
        help="context window of the local cluster's instance, tokens (default: the placement's)",
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="place the local cluster's instance without its prefix cache: every prompt prefilled whole",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        metavar="MODEL",
        help="a model of the same tokenizer (an id or a path) that the local instance's sampling "
        "rank drafts with for speculative decoding, instead of prompt lookup",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="times every level and the short chat run; figures are medians over rounds "
        f"(default 1, with --against {DEFAULT_ROUNDS_AGAINST})",
    )
    parser.add_argument(
        "--against",
        default=None,
        metavar="URL",
        type=node_url,
        help="also benchmark this OpenAI-compatible server (llama.cpp's llama-server, vLLM, "
        "another shardline), interleaved with shardline, and print the ratios",
    )
    parser.add_argument(
        "--against-model", default=None, help="model id at --against (default: its first in GET /v1/models)"
    )
    parser.add_argument("--against-api-key", default=None, help="API key of the server at --against (default none)")
    parser.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="also write the results (with --against: both servers', the ratios and the "
        "order the units ran in) as JSON to PATH",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="after the workload, print each rank's memory: file bytes of its shard, "
        "placement's estimate, resident set steady and at its peaks",
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="keep N cores busy with competing processes while the workloads run "
        "(calibration and warm-up included), as other work on a person's machine "
        "does (default 0)",
    )
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send each server one unmeasured request first (default on)",
    )
