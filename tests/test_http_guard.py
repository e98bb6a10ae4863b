"""Node signatures, the Host allow-list, origins and API keys, as pure decisions (tables)."""

import pytest

from shardline.api.http_guard import ANY, GuardConfig, RequestFacts, check, host_name, names_this_node
from shardline.node import signing

pytestmark = pytest.mark.fast

KEY = signing.signing_key("a cluster key of some length")
OTHER = signing.signing_key("another cluster's key here")
NOW = 1_800_000_000.0


HOST = "10.0.0.5:52415"


def signed(method="POST", target="/internal/state", body=b"{}", now=NOW, key=KEY, host=HOST, member=""):
    request = signing.SignedRequest(method, target, host, member, body)
    return signing.sign_request(key, request, now).header()


def verify(header, method="POST", target="/internal/state", body=b"{}", now=NOW, nonces=None, host=HOST, member=""):
    request = signing.SignedRequest(method, target, host, member, body)
    return signing.verify_request(KEY, header, request, now, nonces or signing.NonceCache())


def test_a_good_signature_passes():
    assert verify(signed()).time == int(NOW)


@pytest.mark.parametrize(
    "header, kwargs, words",
    [
        (None, {}, "no signature"),
        ("Bearer the-key", {}, "malformed"),
        ("t=1,n=abc,s=00", {}, "malformed"),
        (signed(key=OTHER), {}, "wrong signature"),
        (signed(), {"method": "GET"}, "wrong signature"),
        (signed(), {"target": "/internal/tasks"}, "wrong signature"),
        (
            signed(target="/internal/models/file?model=a&path=x"),
            {"target": "/internal/models/file?model=a&path=y"},
            "wrong signature",
        ),
        (signed(), {"body": b'{"a": 1}'}, "wrong signature"),
        (signed(), {"host": "10.0.0.6:52415"}, "wrong signature"),  # replayed to another node
        (signed(member="10.0.0.7:52415"), {"member": "10.0.0.9:52415"}, "wrong signature"),
        (signed(now=NOW - 61), {}, "-61 s from this node's clock"),
        (signed(now=NOW + 120), {}, r"\+120 s from this node's clock"),
    ],
)
def test_bad_signatures_are_refused(header, kwargs, words):
    with pytest.raises(signing.SignatureError, match=words):
        verify(header, **kwargs)


def test_clock_skew_within_the_window_passes():
    assert verify(signed(now=NOW - 59))
    assert verify(signed(now=NOW + 59))


def test_a_replayed_request_is_refused():
    nonces = signing.NonceCache()
    header = signed()
    verify(header, nonces=nonces)
    with pytest.raises(signing.SignatureError, match="replayed"):
        verify(header, now=NOW + 30, nonces=nonces)


def test_the_nonce_cache_forgets_after_its_window_and_stays_bounded():
    cache = signing.NonceCache(window_s=10, max_entries=3)
    assert cache.add("a", 0) and not cache.add("a", 5)
    assert cache.add("a", 11)  # outside the window: the time check refuses such a request anyway
    for i, nonce in enumerate("bcde"):
        assert cache.add(nonce, 12 + i)
    assert len(cache._seen) <= 3


def test_answers_are_bound_to_the_request_status_and_body():
    request = signed()
    nonce = signing.Signature.parse(request).nonce
    good = signing.sign_response(KEY, nonce, 200, "application/json", signing.body_hash(b"{}")).header()
    signing.verify_response(KEY, request, good, 200, "application/json", b"{}")
    for status, body, header in [
        (409, b"{}", good),
        (200, b"{ }", good),
        (200, b"{}", None),
        (200, b"{}", signing.sign_response(OTHER, nonce, 200, "application/json", signing.body_hash(b"{}")).header()),
        (200, b"{}", signing.sign_response(KEY, "another", 200, "application/json", signing.body_hash(b"{}")).header()),
    ]:
        with pytest.raises(signing.SignatureError):
            signing.verify_response(KEY, request, header, status, "application/json", body)
    stream = signing.sign_response(KEY, nonce, 200, "application/x-ndjson", signing.STREAM_BODY).header()
    signing.verify_response(KEY, request, stream, 200, "application/x-ndjson", None)


def test_the_signing_key_is_derived_not_the_key_itself():
    assert KEY != b"a cluster key of some length" and len(KEY) == 32
    assert signing.signing_key("a cluster key of some length") == KEY


HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "10.0.0.5", "box.local"})
KEYED = GuardConfig(api_key="sk-test-key", allowed_hosts=HOSTS)
OPEN = GuardConfig(api_key=None, allowed_hosts=HOSTS)
WITH_CORS = GuardConfig(api_key=None, allowed_hosts=HOSTS, cors_origins=frozenset({"http://app.example"}))


@pytest.mark.parametrize(
    "config, facts, status",
    [
        # Host allow-list: DNS rebinding names another host; a port does not matter.
        (OPEN, RequestFacts("GET", "/v1/models", host="127.0.0.1:52415"), None),
        (OPEN, RequestFacts("GET", "/v1/models", host="[::1]:52415"), None),
        (OPEN, RequestFacts("GET", "/v1/models", host="BOX.local:80"), None),
        (OPEN, RequestFacts("GET", "/v1/models", host="evil.example:52415"), 403),
        (OPEN, RequestFacts("GET", "/", host="evil.example"), 403),
        (OPEN, RequestFacts("GET", "/v1/models", host=None), None),  # HTTP/1.0
        (GuardConfig(allowed_hosts=frozenset({ANY})), RequestFacts("GET", "/v1/models", host="evil.example"), None),
        (OPEN, RequestFacts("POST", "/internal/state", host="evil.example"), None),  # signatures decide
        # Origins: the node's own page may call it; others only when allowed, whatever the body type.
        (
            OPEN,
            RequestFacts("POST", "/v1/chat/completions", host="10.0.0.5:52415", origin="http://10.0.0.5:52415"),
            None,
        ),
        (OPEN, RequestFacts("POST", "/v1/chat/completions", host="10.0.0.5:52415", origin="http://evil.example"), 403),
        (
            OPEN,
            RequestFacts("OPTIONS", "/v1/chat/completions", host="10.0.0.5:52415", origin="http://evil.example"),
            403,
        ),
        (OPEN, RequestFacts("POST", "/v1/chat/completions", host="10.0.0.5:52415", origin="null"), 403),
        (
            WITH_CORS,
            RequestFacts("POST", "/v1/chat/completions", host="10.0.0.5:52415", origin="http://app.example"),
            None,
        ),
        (
            WITH_CORS,
            RequestFacts("POST", "/v1/chat/completions", host="10.0.0.5:52415", origin="http://app.example:8080"),
            403,
        ),
        (
            GuardConfig(allowed_hosts=HOSTS, cors_origins=frozenset({ANY})),
            RequestFacts("POST", "/v1/chat/completions", host="localhost", origin="http://anything.example"),
            None,
        ),
        # API keys: Bearer or x-api-key, on every API and the cluster API.
        (KEYED, RequestFacts("POST", "/v1/chat/completions", host="localhost"), 401),
        (KEYED, RequestFacts("POST", "/v1/chat/completions", authorization="Bearer sk-test-key"), None),
        (KEYED, RequestFacts("POST", "/v1/chat/completions", authorization="bearer sk-test-key"), None),
        (KEYED, RequestFacts("POST", "/v1/chat/completions", authorization="Bearer sk-test-kez"), 401),
        (KEYED, RequestFacts("POST", "/v1/chat/completions", authorization="Basic sk-test-key"), 401),
        (KEYED, RequestFacts("POST", "/v1/messages", x_api_key="sk-test-key"), None),
        (KEYED, RequestFacts("POST", "/v1/messages", x_api_key="wrong"), 401),
        (KEYED, RequestFacts("POST", "/api/chat", authorization="Bearer sk-test-key"), None),
        (KEYED, RequestFacts("GET", "/api/tags"), 401),
        (KEYED, RequestFacts("GET", "/v1/models"), 401),
        (KEYED, RequestFacts("GET", "/cluster/nodes"), 401),
        (KEYED, RequestFacts("DELETE", "/cluster/instances/x"), 401),
        (KEYED, RequestFacts("POST", "/cluster/instances", member=True), None),  # forwarded by a member
        (KEYED, RequestFacts("GET", "/"), None),
        (KEYED, RequestFacts("GET", "/favicon.svg"), None),  # the dashboard's icon, asked before the key
        (KEYED, RequestFacts("GET", "/favicon.ico"), None),
        (KEYED, RequestFacts("GET", "/cluster/connect/claude"), 401),  # its settings hold the key
        (KEYED, RequestFacts("GET", "/health"), None),
        (KEYED, RequestFacts("GET", "/metrics"), None),
        (KEYED, RequestFacts("GET", "/health", host="evil.example"), 403),  # Host first
    ],
)
def test_guard_decisions(config, facts, status):
    refusal = check(config, facts)
    assert (refusal.status if refusal else None) == status, refusal
    if status == 401:
        assert refusal.headers == {"WWW-Authenticate": "Bearer"}
        presented = facts.authorization or facts.x_api_key  # OpenAI's code for a wrong key
        assert refusal.code == (
            "invalid_api_key" if presented and presented.startswith(("Bearer", "bearer", "wrong")) else None
        ), facts


def test_refusals_say_how_to_allow():
    host = check(OPEN, RequestFacts("GET", "/v1/models", host="evil.example:1"))
    assert "--allowed-host evil.example" in host.message
    origin = check(OPEN, RequestFacts("POST", "/v1/models", host="localhost", origin="http://x.example"))
    assert "--cors-origin http://x.example" in origin.message
    empty = check(OPEN, RequestFacts("GET", "/v1/models", host=""))
    assert empty.status == 403 and "empty Host header" in empty.message


@pytest.mark.parametrize(
    "value, name",
    [
        ("127.0.0.1:52415", "127.0.0.1"),
        ("[::1]:1", "::1"),
        ("[::1]", "::1"),
        ("Box.Local", "box.local"),
        ("::1", "::1"),
        ("fe80::1", "fe80::1"),
    ],
)
def test_host_name(value, name):
    assert host_name(value) == name


@pytest.mark.parametrize(
    "host, port, ok",
    [
        ("10.0.0.5:52415", 52415, True),
        ("BOX.local:52415", 52415, True),
        ("10.0.0.5:52416", 52415, False),
        ("10.0.0.6:52415", 52415, False),
        (None, 52415, False),
        ("[::1]:52415", 52415, True),
    ],
)
def test_a_signed_request_must_name_this_node(host, port, ok):
    assert names_this_node(host, HOSTS, port) == ok


def test_the_link_probe_upload_is_signed_without_its_body():
    import time

    import httpx

    request = next(
        signing.SignedAuth(KEY).auth_flow(
            httpx.Request("POST", f"http://{HOST}/internal/echo-bytes", content=b"x" * 1000)
        )
    )
    header = request.headers[signing.AUTH_HEADER]
    now = time.time()
    assert verify(header, target="/internal/echo-bytes", body=None, now=now)
    with pytest.raises(signing.SignatureError, match="wrong signature"):
        verify(header, target="/internal/echo-bytes", body=b"x" * 1000, now=now)
    tasks = next(
        signing.SignedAuth(KEY).auth_flow(httpx.Request("POST", f"http://{HOST}/internal/tasks", content=b"{}"))
    )
    assert verify(tasks.headers[signing.AUTH_HEADER], target="/internal/tasks", body=b"{}", now=now)


def test_a_request_signed_before_the_node_started_is_refused():
    """A restart empties the nonce cache: what was recorded before it must not pass."""
    restarted = signing.NonceCache(not_before=NOW)
    with pytest.raises(signing.SignatureError, match="before this node started"):
        verify(signed(now=NOW - 5), now=NOW + 1, nonces=restarted)
    assert verify(signed(now=NOW), now=NOW + 1, nonces=restarted)


def test_freshness_is_checked_without_the_body():
    nonces = signing.NonceCache()
    header = signed()
    assert signing.check_fresh(header, NOW, nonces).time == int(NOW)
    verify(header, nonces=nonces)
    with pytest.raises(signing.SignatureError, match="replayed"):
        signing.check_fresh(header, NOW + 1, nonces)
    with pytest.raises(signing.SignatureError, match="clock"):
        signing.check_fresh(signed(now=NOW - 120), NOW, nonces)
