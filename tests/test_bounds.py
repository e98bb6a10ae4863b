"""Request bounds as pure decisions: JSON nesting depth, the queue bound, the prompt's
lower bound of tokens, model id length (tables); the body middleware on a bare ASGI app."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest

from shardline.api.bounds import JsonDepthScanner, RequestBoundsMiddleware, json_depth
from shardline.api.prompt_bounds import SAFETY, min_prompt_tokens
from shardline.models.store import ModelStoreError, check_model_id
from shardline.node.queue_bound import RETRY_AFTER_S, admits, retry_after, waiting_count

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]


@pytest.mark.parametrize(
    "text, depth",
    [
        (b"", 0),
        (b"1", 0),
        (b'"[[[["', 0),  # brackets in a string
        (b"[]", 1),
        (b"{}", 1),
        (b'{"a": [1, {"b": [2]}]}', 4),
        (b"[[], [[]], []]", 3),
        (b'["\\"[[[", [1]]', 2),  # an escaped quote does not end the string
        (b'["\\\\", [[1]]]', 3),  # an escaped backslash does
        (b'{"a\\u005b": 1}', 1),
        (b"[" * 1000 + b"]" * 1000, 1000),
        (b"[]," * 1000, 1),
        ('["é[", {"ü": ["{"]}]'.encode(), 3),
    ],
)
def test_json_depth(text, depth):
    assert json_depth(text) == depth
    if text:  # the same fed in pieces of every size, cut anywhere (strings and escapes too)
        for size in (1, 2, 3, 7):
            scanner = JsonDepthScanner()
            for i in range(0, len(text), size):
                scanner.feed(text[i : i + size])
            assert scanner.max_depth == depth, size


def test_json_depth_agrees_with_the_parser_on_generated_json():
    def nest(n: int) -> object:
        value: object = 'x[{\\"'
        for i in range(n):
            value = [value, {"k": i}] if i % 2 else {"k[": value, "n": "}"}
        return value

    def depth(value: object) -> int:
        if isinstance(value, list):
            return 1 + max(map(depth, value), default=0)
        if isinstance(value, dict):
            return 1 + max(map(depth, value.values()), default=0)
        return 0

    for n in range(12):
        value = nest(n)
        assert json_depth(json.dumps(value).encode()) == depth(value), n


def test_json_depth_of_a_large_flat_body_is_quick():
    body = b'{"messages": [' + b'{"role": "user", "content": "[{}] \\" text"},' * 200_000 + b"{}]}"
    started = time.perf_counter()
    assert json_depth(body) == 3
    adversarial = b"[]," * 3_000_000
    assert json_depth(adversarial) == 1
    assert time.perf_counter() - started < 3.0


@pytest.mark.parametrize(
    "own, stats, waiting",
    [
        (set(), None, 0),
        ({1, 2}, None, 2),  # before the first stats: all of this node's requests
        ({1}, {"running": [1], "waiting": [], "held": [], "free_slots": 0}, 0),
        ({1, 2}, {"running": [1], "waiting": [2], "held": [], "free_slots": 0}, 1),
        ({1, 2, 3}, {"running": [1], "waiting": [2], "held": [], "free_slots": 3}, 2),  # 3 queues behind 2
        ({1, 2, 3}, {"running": [1], "waiting": [], "held": [], "free_slots": 1}, 1),  # 2 and 3: one slot
        ({1, 2, 3}, {"running": [1], "waiting": [], "held": [], "free_slots": 4}, 0),
        (set(), {"running": [], "waiting": [7, 8], "held": [9], "free_slots": 0}, 3),  # other nodes' tasks
        ({7}, {"running": [], "waiting": [7, 8], "held": [], "free_slots": 0}, 2),  # counted once
    ],
)
def test_waiting_count(own, stats, waiting):
    assert waiting_count(own, stats) == waiting


@pytest.mark.parametrize(
    "waiting, bound, admitted",
    [(0, 64, True), (63, 64, True), (64, 64, False), (65, 64, False), (0, 0, False), (1, 2, True)],
)
def test_admits(waiting, bound, admitted):
    assert admits(waiting, bound) is admitted


@pytest.mark.parametrize(
    "header, seconds",
    [
        (None, RETRY_AFTER_S),
        ("5", 5),
        (" 12 ", 12),
        ("Wed, 21 Oct 2015 07:28:00 GMT", RETRY_AFTER_S),
        ("-1", RETRY_AFTER_S),
    ],
)
def test_retry_after(header, seconds):
    assert retry_after(header) == seconds


@pytest.mark.parametrize(
    "prompt, longest, tokens",
    [
        ("", 10, 0),
        ("a", 10, 1),
        ("a" * 40, 10, 1),
        ("a" * 41, 10, 2),
        ("a" * 4_000_000, 16, 4_000_000 // (16 * SAFETY)),
        ([{"role": "user", "content": "hi"}], 10, 1),
        ([{"role": "user", "content": "hi"}] * 500, 100, 500),  # one per turn at least
        ([{"role": "assistant", "content": "x" * 10_000}], 1, 1),  # a template may shorten it: its turn
        ([{"role": "system", "content": "x" * 400}, {"role": "user", "content": ""}], 10, 10),
        ([{"role": "user"}] * 1_000_000, 80, 1_000_000),  # empty turns are turns too
        ([{"role": "user", "content": ""}, {"role": "assistant", "content": None}], 80, 2),
    ],
)
def test_min_prompt_tokens(prompt, longest, tokens):
    assert min_prompt_tokens(prompt, longest) == tokens


@pytest.mark.parametrize(
    "model_id, ok",
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("a" * 96, True),
        ("a" * 96 + "/" + "b" * 96, True),
        ("a" * 97, False),
        ("org/" + "b" * 5000, False),
        ("a/../b", False),
    ],
)
def test_check_model_id_bounds_the_length(model_id, ok):
    if ok:
        assert check_model_id(model_id) == model_id
    else:
        with pytest.raises(ModelStoreError) as info:
            check_model_id(model_id)
        assert len(str(info.value)) < 300  # the id is cut in the message


def _run_app(middleware_args: dict, headers: list, chunks: list[bytes], path: str = "/v1/chat/completions"):
    """Run a request through the middleware around an app that reads the whole body and
    answers 200; return (messages sent, bytes the app received)."""
    received = []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            received.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(RequestBoundsMiddleware(app, **middleware_args)(scope, receive, send))
    return sent, b"".join(received)


def _status_and_body(sent) -> tuple[int, dict | bytes]:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        return sent[0]["status"], json.loads(body)
    except ValueError:
        return sent[0]["status"], body


def test_middleware_refuses_a_content_length_over_the_limit_unread():
    sent, received = _run_app({"max_body_bytes": 100}, [(b"content-length", b"101")], [b"x" * 101])
    status, body = _status_and_body(sent)
    assert status == 413 and received == b""
    assert body["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "chunks, path, status, shape",
    [
        ([b"[1]"] * 10, "/v1/chat/completions", 200, None),  # 30 bytes, depth 1
        ([b"x" * 60] * 2, "/api/chat", 413, "error"),  # no Content-Length: counted as it comes
        ([b"[" * 40, b"[" * 40], "/cluster/instances", 400, "error"),  # 80 deep
        ([b"[" * 40, b"[" * 40], "/v1/messages", 400, "type"),
    ],
)
def test_middleware_counts_and_scans_chunks(chunks, path, status, shape):
    sent, received = _run_app({"max_body_bytes": 100, "max_json_depth": 64}, [], chunks, path)
    got, body = _status_and_body(sent)
    assert got == status
    if status == 200:
        assert body == b"ok" and received == b"".join(chunks)
    else:
        assert shape in body
        assert len([m for m in sent if m["type"] == "http.response.start"]) == 1  # the app's answer dropped


def test_middleware_scans_every_content_type_but_not_the_link_probe_upload():
    octet = [(b"content-type", b"application/octet-stream")]
    sent, _ = _run_app({"max_json_depth": 2}, octet, [b"[[[[[[[["], "/v1/chat/completions")
    assert _status_and_body(sent)[0] == 400  # the APIs parse JSON whatever its type
    sent, _ = _run_app({"max_json_depth": 2}, octet, [b"[[[[[[[["], "/internal/echo-bytes")
    assert _status_and_body(sent)[0] == 200


@pytest.mark.parametrize(
    "first, refused",
    [
        ('{"a": 1}'.encode("utf-16"), True),
        ('{"a": 1}'.encode("utf-16-le"), True),
        ('{"a": 1}'.encode("utf-16-be"), True),
        ('{"a": 1}'.encode("utf-32"), True),
        (b'{"a": 1}', False),
        ('{"é": 1}'.encode(), False),
    ],
)
def test_middleware_refuses_json_that_is_not_utf8(first, refused):
    sent, _ = _run_app({}, [], [first], "/v1/chat/completions")
    status, body = _status_and_body(sent)
    assert (status == 400) == refused
    if refused:
        assert body["error"]["code"] == "not_utf8"


def test_run_defaults_are_the_issues_bounds():
    from shardline.cli import build_parser

    args = build_parser().parse_args(["run"])
    assert (args.max_body_bytes, args.max_waiting, args.header_timeout) == (16 * 1024 * 1024, 64, 10.0)
    args = build_parser().parse_args(["run", "--max-body-bytes", "1MiB", "--max-waiting", "0"])
    assert (args.max_body_bytes, args.max_waiting) == (1 << 20, 0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--max-waiting", "-1"])


def test_version_goes_to_stdout(capsys):
    """As argparse's own version action prints it: v=$(shardline --version) captures it."""
    from shardline.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    out, err = capsys.readouterr()
    assert exited.value.code == 0 and out.startswith("shardline ") and err == ""


def test_middleware_refuses_too_many_objects():
    messages = b'{"messages": [' + b",".join([b'{"role": "user"}'] * 11) + b"]}"
    sent, _ = _run_app({"max_json_objects": 10}, [], [messages[:50], messages[50:]])
    status, body = _status_and_body(sent)
    assert status == 400 and body["error"]["code"] == "json_too_many_objects"
    sent, _ = _run_app({"max_json_objects": 12}, [], [messages])
    assert _status_and_body(sent)[0] == 200
    strings = b'{"content": "' + b"{" * 1000 + b'"}'  # braces inside a string are text
    sent, _ = _run_app({"max_json_objects": 10}, [], [strings])
    assert _status_and_body(sent)[0] == 200


def test_middleware_answers_408_to_a_body_that_stops_coming():
    """Headers and part of a body, then nothing: 408 after the body timeout, not a
    connection held for ever; once the body is complete, receive waits unbounded (a
    streaming handler waits on it for the client's disconnect)."""
    waited = []

    async def app(scope, receive, send):
        message = await receive()
        while message.get("more_body"):
            message = await receive()
        waited.append(await receive())  # after the body: the disconnect, however late
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def run(messages: list, delays: list[float]) -> list:
        sent = []

        async def receive():
            await asyncio.sleep(delays.pop(0))
            return messages.pop(0)

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": [(b"content-length", b"100")],
        }
        asyncio.run(RequestBoundsMiddleware(app, body_timeout_s=0.2)(scope, receive, send))
        return sent

    stalled = run([{"type": "http.request", "body": b"{", "more_body": True}], [0.0, 10.0])
    status, body = _status_and_body(stalled)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    done = run([{"type": "http.request", "body": b"{}", "more_body": False}, {"type": "http.disconnect"}], [0.1, 0.5])
    assert _status_and_body(done)[0] == 200 and waited == [{"type": "http.disconnect"}]


@pytest.mark.parametrize(
    "given, url",
    [
        ("127.0.0.1:9200", "http://127.0.0.1:9200"),
        ("http://a:1", "http://a:1"),
        ("https://node.lan", "https://node.lan"),
        ("ftp://x", None),
        ("http://", None),
        # what place prints ("serves at http://...:52415/v1"): the API's base path left out
        ("http://10.0.0.2:52415/v1", "http://10.0.0.2:52415"),
        ("10.0.0.2:1/v1/", "http://10.0.0.2:1"),
        ("http://a:1/", "http://a:1"),
        # an address alone: a node's default port (a URL with a scheme means what it says)
        ("10.0.0.2", "http://10.0.0.2:52415"),
        ("10.0.0.2/v1", "http://10.0.0.2:52415"),
        ("http://10.0.0.2", "http://10.0.0.2"),
    ],
)
def test_a_node_url_without_a_scheme_is_http(given, url):
    import argparse

    from shardline.cluster_commands import node_url

    if url is None:
        with pytest.raises(argparse.ArgumentTypeError):
            node_url(given)
    else:
        assert node_url(given) == url


@pytest.mark.parametrize(
    "argv, words",
    [
        (["cluster", "--nodes", "0"], "--nodes must be at least 1"),
        (["run", "--port", "99999"], "--port must lie in 1-65535"),
        (["cluster", "--port", "65535", "--nodes", "2"], "plus one per extra node"),
        (["place", "--timeout", "-1"], "--timeout must be above 0 seconds"),
        (["cluster", "--sharding", "bogus"], "(choose from 'auto', 'pipeline', 'tensor', 'ring', 'expert')"),
        (["place", "--sharding", "bogus"], "(choose from 'auto', 'pipeline', 'tensor', 'ring', 'expert')"),
    ],
)
def test_a_bad_argument_is_named_with_its_commands_usage(argv, words, capsys):
    from shardline.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and words in err and f"shardline {argv[0]}: error" in err


@pytest.mark.parametrize(
    "given, address",
    [
        ("10.0.0.2", "10.0.0.2:52415"),
        (" host.local ", "host.local:52415"),
        ("10.0.0.2:9000", "10.0.0.2:9000"),
        ("[fd00::2]", "[fd00::2]:52415"),
        ("[fd00::2]:9", "[fd00::2]:9"),
    ],
)
def test_a_peer_without_a_port_gets_the_default_port(given, address):
    from shardline.cli import peer_address

    assert peer_address(given) == address


@pytest.mark.parametrize(
    "host, here",
    [
        ("127.0.0.1", True),
        ("127.0.0.9", True),
        ("localhost", True),
        ("0.0.0.0", True),
        ("192.0.2.1", False),  # TEST-NET-1 (RFC 5737): no machine's own address
        ("no-such-host.invalid", False),
    ],
)
def test_address_is_here(host, here):
    from shardline.local_cluster import address_is_here

    assert address_is_here(host) is here


def test_run_on_another_machines_address_says_so(capsys, monkeypatch):
    """Trial 5: ``--host`` of an address not on this machine said the port was in use."""
    from shardline.cli import main

    # (run keeps torch out of the node's process by a None in sys.modules: undone after)
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch"))
    assert main(["run", "--host", "192.0.2.1", "--no-api-key"]) == 2
    assert "192.0.2.1 is not an address of this machine" in capsys.readouterr().err


def test_a_chat_loses_its_oldest_messages_but_system_and_last():
    from shardline.api.prompt_bounds import droppable, without_oldest

    def chat(*roles: str) -> list[dict]:
        return [{"role": r, "content": str(i)} for i, r in enumerate(roles)]

    full = chat("system", "user", "assistant", "user")
    assert droppable(full) == 2
    assert [[m["content"] for m in without_oldest(full, k)] for k in range(4)] == [
        ["0", "1", "2", "3"],
        ["0", "2", "3"],
        ["0", "3"],
        ["0", "3"],
    ]
    assert droppable(chat("user")) == 0 and droppable(chat("system", "user")) == 0
    mixed = chat("user", "system", "user", "user")
    assert [m["content"] for m in without_oldest(mixed, droppable(mixed))] == ["1", "3"]
    started = time.monotonic()  # linear: a 5,000-message chat in milliseconds
    long = chat(*["user"] * 5000)
    assert len(without_oldest(long, droppable(long))) == 1 and time.monotonic() - started < 0.5


def test_an_interrupted_command_says_so_in_one_line(monkeypatch, capsys):
    """Ctrl-C while a node still imports (``shardline cluster`` stopped in its first
    seconds) printed each node's traceback; now one line and exit status 130."""
    import shardline.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    assert cli.main(["run"]) == 130
    err = capsys.readouterr().err
    assert err == "shardline run: interrupted\n"
