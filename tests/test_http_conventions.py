"""The node app's HTTP conventions, in process (a node that is not started): 405 with every
method in ``Allow``, ``X-Request-Id`` on every answer, the cluster API's error shape, and
the refusals that need no model (content parts, keep_alive, embeddings)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from shardline.api.app import create_app
from shardline.api.http_guard import GuardConfig
from shardline.models.store import DEFAULT_MODEL_ID, ModelStore
from shardline.node.node import Node

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    node = Node("127.0.0.1", 1, [], "n0", "k" * 32, ModelStore(tmp_path_factory.mktemp("store")))
    app = create_app(node, GuardConfig(allowed_hosts=frozenset({"127.0.0.1"})))

    async def boom():
        raise RuntimeError("a bug")

    app.add_api_route("/cluster/boom", boom)
    return app


def call(app, *requests: tuple) -> list[httpx.Response]:
    """Send ``(method, path, json body or None, headers or None)`` requests in order."""

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return [await client.request(m, p, json=b, headers=h) for m, p, b, h in requests]

    return asyncio.run(run())


@pytest.mark.parametrize(
    "method, path, allow",
    [
        ("PUT", "/cluster/instances", "GET, POST"),
        ("PATCH", "/cluster/instances/abc", "DELETE, GET"),
        ("POST", "/health", "GET, HEAD"),
        ("GET", "/api/chat", "POST"),
        ("DELETE", "/v1/models", "GET"),
    ],
)
def test_405_allows_every_method_of_the_path(app, method, path, allow):
    [response] = call(app, (method, path, None, None))
    assert response.status_code == 405 and response.headers["allow"] == allow


def test_405_allows_the_methods_of_every_router(app):
    """A path served by two routes of one included router (the Responses API's GET and
    DELETE of a stored response) names both, as a path of the app's own routes does."""
    [response] = call(app, ("PUT", "/v1/responses/abc", None, None))
    assert response.status_code == 405 and response.headers["allow"] == "DELETE, GET"


def test_every_answer_carries_a_request_id(app):
    ok, refused, failed, odd, long = call(
        app,
        ("GET", "/api/version", None, {"X-Request-Id": "client-id-1"}),
        ("GET", "/nope", None, {"X-Request-Id": "client-id-2"}),
        ("GET", "/cluster/boom", None, {"X-Request-Id": "client-id-3"}),
        ("GET", "/api/version", None, {"X-Request-Id": "a\tb"}),
        ("GET", "/api/version", None, {"X-Request-Id": "x" * 129}),
    )
    assert ok.headers["x-request-id"] == "client-id-1"
    assert refused.status_code == 404 and refused.headers["x-request-id"] == "client-id-2"
    assert failed.status_code == 500 and failed.headers["x-request-id"] == "client-id-3"
    made = {odd.headers["x-request-id"], long.headers["x-request-id"]}
    assert len(made) == 2 and all(len(r) == 32 and int(r, 16) >= 0 for r in made)
    [first, second] = call(app, ("GET", "/api/version", None, None), ("GET", "/api/version", None, None))
    assert first.headers["x-request-id"] != second.headers["x-request-id"]


@pytest.mark.parametrize(
    "method, path, body, status, param",
    [
        ("GET", "/cluster/instances/abc", None, 404, "instance_id"),
        ("DELETE", "/cluster/instances/abc", None, 503, None),  # not started: no coordinator yet
        ("POST", "/cluster/instances", {"model": "./nowhere/x.gguf"}, 400, "model"),
        ("POST", "/cluster/instances", {"context": 0}, 400, "context"),
        # trial 9: an unknown key was ignored (a mistyped "nodez" placed on every node) and
        # values of another type were coerced
        ("POST", "/cluster/instances", {"model": "m", "nodez": ["x"]}, 400, "nodez"),
        ("POST", "/cluster/instances", {"model": "m", "force": "yes"}, 400, "force"),
        ("POST", "/cluster/instances", {"model": "m", "context": "2048"}, 400, "context"),
        ("POST", "/cluster/placements/preview", {"bogus": 1}, 400, "bogus"),
        ("GET", "/cluster/boom", None, 500, None),
        ("GET", "/no-such-path", None, 404, None),
    ],
)
def test_cluster_api_errors_have_the_error_shape(app, method, path, body, status, param):
    [response] = call(app, (method, path, body, None))
    assert response.status_code == status, response.text
    assert (response.headers.get("retry-after") == "2") == (status == 503)  # when to try again
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param


@pytest.mark.parametrize(
    "path, body, status, shape, words",
    [
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": []}]},
            400,
            "openai",
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}
                ],
            },
            400,
            "openai",
            "model 'm' takes text only",
        ),
        (
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}
                        ],
                    }
                ],
            },
            400,
            "anthropic",
            "model 'm' takes text only",
        ),
        (
            "/v1/messages",
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": []}]},
            400,
            "anthropic",
            "messages.0.content",
        ),
        (
            "/api/chat",
            {"model": "m", "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
            400,
            "ollama",
            "model 'm' takes text only",
        ),
        ("/api/chat", {"model": "m", "messages": [], "keep_alive": "10"}, 400, "ollama", "keep_alive"),
        ("/api/generate", {"model": "m", "keep_alive": "5 minutes"}, 400, "ollama", "keep_alive"),
        ("/api/chat", {"model": "m"}, 404, "ollama", "model 'm' not found"),
        ("/api/show", {"model": "m"}, 404, "ollama", "model 'm' not found"),
        ("/api/embed", {"model": "m", "input": "hi"}, 404, "ollama", "model 'm' not found"),
        ("/api/embeddings", {"model": "m", "prompt": "hi"}, 404, "ollama", "model 'm' not found"),
        ("/v1/embeddings", {"model": "m", "input": "hi"}, 404, "openai", "'m' does not exist"),
    ],
)
def test_refusals_that_need_no_model(app, path, body, status, shape, words):
    [response] = call(app, ("POST", path, body, None))
    assert response.status_code == status, response.text
    data = response.json()
    message = {
        "openai": lambda: data["error"]["message"],
        "anthropic": lambda: data["error"]["message"],
        "ollama": lambda: data["error"],
    }[shape]()
    assert words in message, message


def test_without_instances_ps_is_empty_and_tags_list_what_a_request_would_load(app):
    ps, tags = call(app, ("GET", "/api/ps", None, None), ("GET", "/api/tags", None, None))
    assert ps.json() == {"models": []}
    (default,) = tags.json()["models"]  # the embedded model, loaded on the first request
    assert default["name"] == DEFAULT_MODEL_ID and default["size"] > 0 and "sharding" not in default["details"]


@pytest.mark.fast
@pytest.mark.parametrize(
    "error, message, param",
    [
        (
            {
                "type": "value_error",
                "loc": ("body",),
                "msg": "Value error, give nodes, or min_nodes / max_nodes, not both",
            },
            "give nodes, or min_nodes / max_nodes, not both",
            None,
        ),
        (
            {"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be an object"},
            "body: Input should be an object",
            None,
        ),
        (
            {"type": "int_type", "loc": ("body", "context"), "msg": "Input should be a valid integer"},
            "context: Input should be a valid integer",
            "context",
        ),
    ],
)
def test_the_cluster_apis_validation_messages_read_plainly(error, message, param):
    from fastapi.exceptions import RequestValidationError

    from shardline.api.exception_handlers import validation_message

    assert validation_message(RequestValidationError([error])) == (message, param)
