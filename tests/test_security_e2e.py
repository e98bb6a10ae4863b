"""API keys, the Host allow-list and cross-origin requests on a running node (1 node on
127.0.0.1 serving the default model, started with an API key and one allowed origin)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from conftest import free_port_block

from shardline.local_cluster import LocalCluster
from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.timeout(300)

API_KEY = "sk-shardline-test-0123456789"
APP = "http://app.example"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    path = tmp_path_factory.mktemp("keyed")
    cluster = LocalCluster(
        nodes=1,
        base_port=free_port_block(1),
        runner_threads=1,
        log_dir=str(path),
        data_dir=str(path),
        api_key=API_KEY,
        node_args={0: ["--cors-origin", APP]},
    )
    try:
        cluster.start()
        cluster.place(None, "pipeline")
        yield cluster.url(0)
    finally:
        cluster.stop()


BEARER = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": DEFAULT_MODEL_ID, "messages": HI, "max_tokens": 2}


@pytest.mark.parametrize(
    "method, path, body, good, error",
    [
        ("POST", "/v1/chat/completions", CHAT, BEARER, lambda e: e["error"]["message"]),
        (
            "POST",
            "/v1/completions",
            {"model": DEFAULT_MODEL_ID, "prompt": "hi", "max_tokens": 2},
            BEARER,
            lambda e: e["error"]["message"],
        ),
        ("GET", "/v1/models", None, BEARER, lambda e: e["error"]["message"]),
        (
            "POST",
            "/v1/messages",
            CHAT,
            {"x-api-key": API_KEY},
            lambda e: e["type"] == "error" and e["error"]["type"] == "authentication_error" and e["error"]["message"],
        ),
        (
            "POST",
            "/api/chat",
            {"model": DEFAULT_MODEL_ID, "messages": HI, "stream": False, "options": {"num_predict": 2}},
            BEARER,
            lambda e: e["error"],
        ),
        ("GET", "/api/tags", None, BEARER, lambda e: e["error"]),
        ("GET", "/cluster/nodes", None, BEARER, lambda e: e["error"]["message"]),
        ("POST", "/cluster/placements/preview", {"sharding": "pipeline"}, BEARER, lambda e: e["error"]["message"]),
    ],
)
def test_every_api_needs_the_key_and_answers_in_its_format(keyed, method, path, body, good, error):
    for headers in ({}, {"Authorization": "Bearer wrong-key-1234"}, {"x-api-key": "wrong-key-1234"}):
        refused = httpx.request(method, keyed + path, json=body, headers=headers, timeout=60)
        assert refused.status_code == 401, refused.text
        assert error(refused.json())
        assert refused.headers["www-authenticate"] == "Bearer"
    served = httpx.request(method, keyed + path, json=body, headers=good, timeout=60)
    assert served.status_code == 200, served.text


def test_cluster_writes_need_the_key(keyed):
    assert httpx.delete(f"{keyed}/cluster/instances/anything", timeout=10).status_code == 401
    assert httpx.post(f"{keyed}/cluster/instances", json={}, timeout=10).status_code == 401
    assert len(httpx.get(f"{keyed}/cluster/instances", headers=BEARER, timeout=10).json()["instances"]) == 1


def test_health_metrics_and_dashboard_page_are_open(keyed):
    for path in ("/health", "/metrics", "/"):
        assert httpx.get(keyed + path, timeout=10).status_code == 200, path
    for path in ("/health", "/"):
        assert httpx.head(keyed + path, timeout=10).status_code == 200, path
    page = httpx.get(keyed + "/", timeout=10)  # never inside another site's frame (clickjacking)
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["content-security-policy"] == "frame-ancestors 'none'"


def test_a_rebinding_host_is_refused(keyed):
    response = httpx.get(f"{keyed}/health", headers={"Host": "attacker.example:80"}, timeout=10)
    assert response.status_code == 403 and "--allowed-host attacker.example" in response.json()["error"]["message"]
    chat = httpx.post(
        f"{keyed}/v1/chat/completions", json=CHAT, timeout=10, headers={"Host": "attacker.example", **BEARER}
    )
    assert chat.status_code == 403 and chat.json()["error"]["message"]


def test_cross_origin_requests(keyed):
    url = f"{keyed}/v1/chat/completions"
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    allowed = httpx.options(url, headers={"Origin": APP, **preflight}, timeout=10)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == APP
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    refused = httpx.options(url, headers={"Origin": "http://evil.example", **preflight}, timeout=10)
    assert refused.status_code == 403 and "--cors-origin" in refused.json()["error"]["message"]
    assert "access-control-allow-origin" not in refused.headers
    # A "simple" request (no preflight in a browser) from another origin is refused even
    # with the key, whatever its content type; the allowed origin's gets CORS headers.
    body = httpx.Request("POST", url, json=CHAT).content
    evil = httpx.post(
        url, content=body, timeout=60, headers={"Origin": "http://evil.example", "Content-Type": "text/plain", **BEARER}
    )
    assert evil.status_code == 403 and "--cors-origin" in evil.json()["error"]["message"]
    ok = httpx.post(url, json=CHAT, timeout=60, headers={"Origin": APP, **BEARER})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == APP
    # The node's own dashboard (same origin) calls it without any --cors-origin.
    own = httpx.post(url, json=CHAT, timeout=60, headers={"Origin": keyed, **BEARER})
    assert own.status_code == 200


def test_a_node_on_a_lan_address_needs_an_api_key(tmp_path):
    port = free_port_block(1)
    command = [
        sys.executable,
        "-m",
        "shardline.cli",
        "run",
        "--host",
        "192.0.2.10",
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    )
    assert done.returncode == 2 and "--api-key" in done.stderr and "--no-api-key" in done.stderr


def test_the_cluster_commands_send_the_key(keyed):
    command = [sys.executable, "-m", "shardline.cli", "instances", "--url", keyed]
    refused = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    )
    assert refused.returncode == 1 and "401" in refused.stderr
    listed = subprocess.run(
        command + ["--api-key", API_KEY],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"},
    )
    assert listed.returncode == 0 and "ready" in listed.stdout, listed.stderr
    from_env = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", "SHARDLINE_API_KEY": API_KEY},
    )
    assert from_env.returncode == 0
