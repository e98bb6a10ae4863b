"""Request bounds on a real node (issue 14, item 5): body size, JSON depth, model id
length, the cheap context check, the queue bound, the header timeout, and 500s in JSON.

One node serving the default model with ``max_batch`` 1, the default ``--max-waiting``
(64) and ``--header-timeout 2``: one request runs, 64 wait, and the next is refused (the
decision, ``queue_bound.admits``, is also table-tested in test_bounds.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import psutil
import pytest
from conftest import free_port_block

from shardline.local_cluster import LocalCluster
from shardline.models.store import DEFAULT_MODEL_ID
from shardline.node.queue_bound import DEFAULT_MAX_WAITING

pytestmark = pytest.mark.timeout(300)

HEADER_TIMEOUT_S = 2
WAITING = DEFAULT_MAX_WAITING  # the 66th concurrent request: 1 runs, 64 wait, it gets 429


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    """A 1-node cluster: max_batch 1, the default --max-waiting (64), --header-timeout 2."""
    log_dir = tmp_path_factory.mktemp("bounds")
    cluster = LocalCluster(
        nodes=1,
        base_port=free_port_block(1),
        runner_threads=1,
        log_dir=str(log_dir),
        data_dir=str(log_dir),
        node_args={0: ["--header-timeout", str(HEADER_TIMEOUT_S)]},
    )
    try:
        cluster.start()
        cluster.place(None, "pipeline", max_batch=1)
        yield cluster
    finally:
        cluster.stop()


def node_rss(cluster: LocalCluster) -> int:
    """Bytes resident in the node process (its runner is a child, not counted)."""
    proc = cluster.procs[0]
    assert proc is not None
    return psutil.Process(proc.pid).memory_info().rss


def chat(content: str, **extra) -> dict:
    return {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": content}], **extra}


def test_a_20_mb_body_gets_413_at_once_and_is_not_read(bounded):
    body = json.dumps(chat("a" * 20_000_000)).encode()
    before = node_rss(bounded)
    started = time.monotonic()
    response = httpx.post(
        f"{bounded.url(0)}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    elapsed = time.monotonic() - started
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    assert elapsed < 1.0

    def pieces():  # no Content-Length: chunked, counted as it arrives
        for i in range(0, len(body), 1 << 20):
            yield body[i : i + (1 << 20)]

    started = time.monotonic()
    response = httpx.post(f"{bounded.url(0)}/api/chat", content=pieces(), timeout=30)
    assert response.status_code == 413 and "limit" in response.json()["error"]
    assert time.monotonic() - started < 1.0
    assert node_rss(bounded) - before < 50_000_000


@pytest.mark.parametrize(
    "path, message",
    [
        ("/v1/chat/completions", lambda b: b["error"]["message"]),
        ("/v1/completions", lambda b: b["error"]["message"]),
        ("/v1/messages", lambda b: b["error"]["message"]),
        ("/api/chat", lambda b: b["error"]),
        ("/api/generate", lambda b: b["error"]),
        ("/cluster/instances", lambda b: b["error"]["message"]),
        ("/cluster/placements/preview", lambda b: b["error"]["message"]),
    ],
)
def test_json_nested_1000_deep_gets_400_in_the_apis_format(bounded, path, message):
    body = b'{"model": "m", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    response = httpx.post(bounded.url(0) + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    assert "nests deeper than 64" in message(response.json())


@pytest.mark.parametrize("path", ["/cluster/instances", "/cluster/placements/preview"])
@pytest.mark.parametrize("model", ["a" * 5000, "org/" + "b" * 5000, "./" + "c" * 5000])
def test_a_5000_character_model_name_gets_400_naming_the_problem(bounded, path, model):
    response = httpx.post(bounded.url(0) + path, json={"model": model}, timeout=30)
    assert response.status_code == 400, response.text
    detail = response.json()["error"]["message"]
    assert "too long" in detail or "nor a path under a --model-dir" in detail  # ./...: a path, not allowed
    assert len(detail) < 400


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(bounded):
    before = node_rss(bounded)
    started = time.monotonic()
    response = httpx.post(f"{bounded.url(0)}/v1/chat/completions", json=chat("hello " * 2_000_000), timeout=60)
    elapsed = time.monotonic() - started
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in response.json()["error"]["message"]  # the estimate, not the count
    assert elapsed < 5.0
    assert node_rss(bounded) - before < 200_000_000  # tokenizing 12 MB took gigabytes
    # 5,000 one-word turns: refused by the count of turns, each takes a token at least
    turns = [{"role": "user", "content": "hi"}] * 5000
    response = httpx.post(
        f"{bounded.url(0)}/v1/chat/completions",
        timeout=60,
        json={"model": DEFAULT_MODEL_ID, "messages": turns, "max_tokens": 1},
    )
    assert response.status_code == 400 and "at least 5000" in response.json()["error"]["message"]
    # Ollama's /api/chat answers from the chat's end, as Ollama does (a binary search over
    # the shorter chats: a dozen encodings, not 5,000)
    started = time.monotonic()
    response = httpx.post(
        f"{bounded.url(0)}/api/chat",
        timeout=60,
        json={
            "model": DEFAULT_MODEL_ID,
            "stream": False,
            "messages": turns,
            "options": {"num_predict": 1, "num_ctx": 256},
        },
    )
    assert response.status_code == 200, response.text
    assert 128 < response.json()["prompt_eval_count"] < 256
    assert time.monotonic() - started < 30


def test_the_estimate_never_exceeds_the_tokenizers_count(tmp_path):
    from shardline.api.prompt_bounds import min_prompt_tokens
    from shardline.models.store import ModelStore
    from shardline.models.tokenizer import Tokenizer

    tokenizer = Tokenizer(ModelStore(tmp_path).tokenizer_path(DEFAULT_MODEL_ID))
    texts = [
        "Hello, world!",
        " " * 500,
        "=" * 300,
        "é" * 200,
        "日本語のテキスト" * 30,
        "<|im_end|>" * 20,
        "\n\n\n" * 50,
        "".join(chr(c) for c in range(32, 3000)),
        "a" * 1000,
    ]
    for text in texts:
        assert min_prompt_tokens(text, tokenizer.max_token_chars) <= len(tokenizer.encode(text)), text[:20]
    messages = [{"role": "user", "content": t} for t in texts]
    assert min_prompt_tokens(messages, tokenizer.max_token_chars) <= len(tokenizer.encode_chat(messages))


def test_past_the_waiting_bound_a_request_gets_429_and_the_others_are_served(bounded):
    url = bounded.url(0)

    async def stream(client: httpx.AsyncClient, i: int, results: dict, first_tokens: dict) -> None:
        body = chat(f"Count to a thousand, {i}.", stream=True, max_tokens=2000, ignore_eos=True)
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            results[i] = response
            if response.status_code != 200:
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {") or i in first_tokens:
                    continue
                choices = json.loads(line[len("data: ") :])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    first_tokens[i] = time.monotonic()

    async def waiting() -> int:
        async with httpx.AsyncClient(timeout=10) as client:
            engine = (await client.get(f"{url}/cluster/instances")).json()["instances"][0]["local_engine"]
            return len(engine["waiting"]) + len(engine["held"])

    async def run() -> None:
        results: dict[int, httpx.Response] = {}
        first_tokens: dict[int, float] = {}
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(stream(client, 0, results, first_tokens))]
            for i in range(1, WAITING + 1):  # one runs (max_batch 1), then 64 wait
                deadline = time.monotonic() + 60
                while i - 1 not in results and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                tasks.append(asyncio.create_task(stream(client, i, results, first_tokens)))
            deadline = time.monotonic() + 60
            while await waiting() < WAITING and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert await waiting() == WAITING
            refused = await client.post(f"{url}/v1/chat/completions", json=chat("One more."))
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["type"] == "rate_limit_exceeded"
            assert int(refused.headers["Retry-After"]) >= 1
            anthropic = await client.post(f"{url}/v1/messages", json=chat("One more.", max_tokens=5))
            assert anthropic.status_code == 429 and anthropic.json()["error"]["type"] == "rate_limit_error"
            assert [results[i].status_code for i in range(WAITING + 1)] == [200] * (WAITING + 1)
            assert 0 in first_tokens  # the running one streams meanwhile
            tasks[0].cancel()  # the first leaves: the next waiting one starts and streams
            deadline = time.monotonic() + 60
            while 1 not in first_tokens and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert 1 in first_tokens
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.monotonic() + 30
        while await waiting() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        async with httpx.AsyncClient(timeout=120) as client:  # room again once they left
            response = await client.post(f"{url}/v1/chat/completions", json=chat("Hi.", max_tokens=3))
            assert response.status_code == 200

    asyncio.run(run())


def test_a_connection_that_never_finishes_its_headers_is_closed(bounded):
    port = bounded.base_port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /hea")  # half a request line, then nothing
        started = time.monotonic()
        assert sock.recv(100) == b""  # closed by the node
        assert HEADER_TIMEOUT_S - 0.5 < time.monotonic() - started < HEADER_TIMEOUT_S + 2
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # a slow but whole request
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(HEADER_TIMEOUT_S / 2)
        sock.sendall(b"Host: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200")


def test_a_handler_that_raises_gets_a_json_500_in_the_apis_format(tmp_path):
    from shardline.api.app import create_app
    from shardline.api.http_guard import GuardConfig
    from shardline.models.store import ModelStore
    from shardline.node.node import Node

    node = Node("127.0.0.1", 1, [], "n0", "k" * 32, ModelStore(tmp_path))
    app = create_app(node, GuardConfig(allowed_hosts=frozenset({"127.0.0.1"})))

    async def boom():
        raise RuntimeError("a bug")

    for path in ("/v1/boom", "/v1/messages/boom", "/api/boom", "/cluster/boom"):
        app.add_api_route(path, boom)

    async def run() -> dict[str, httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return {p: await client.get(p) for p in ("/v1/boom", "/v1/messages/boom", "/api/boom", "/cluster/boom")}

    responses = asyncio.run(run())
    for response in responses.values():
        assert response.status_code == 500
        assert response.headers["content-type"] == "application/json"
        assert "a bug" not in response.text and "Traceback" not in response.text
    assert responses["/v1/boom"].json()["error"]["type"] == "server_error"
    assert responses["/v1/messages/boom"].json()["error"]["type"] == "api_error"
    assert "internal error" in responses["/api/boom"].json()["error"]
    assert "internal error" in responses["/cluster/boom"].json()["error"]["message"]
