"""The pure parts of Ollama's endpoints and the HTTP conventions, by tables: keep_alive,
expiry, model details, content parts, X-Request-Id and Allow."""

from __future__ import annotations

import math

import pytest
from conftest import one_rank_instance

from shardline.api.content import check_parts
from shardline.api.errors import API, error_body, error_message
from shardline.api.http_extras import allow_value, request_id
from shardline.api.keep_alive import KeepAlive, expired, load_state, parse_keep_alive
from shardline.api.model_facts import (
    dtype_quantization,
    gguf_quantization,
    human_number,
    manifest_digest,
    parameter_count,
)
from shardline.api.ollama import capabilities, default_parameters, modelfile_text, parameters_text
from shardline.api.text_stream import APIError
from shardline.node.status import InstanceStatus

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "value, seconds",
    [
        (None, None),
        (0, 0.0),
        ("0", 0.0),
        (300, 300.0),
        (1.5, 1.5),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("300ms", 0.3),
        ("1.5h", 5400.0),
        ("2h45m30.5s", 9930.5),
        ("10us", 1e-5),
        ("+5s", 5.0),
        (-1, math.inf),
        ("-1m", math.inf),
        ("-0", 0.0),
    ],
)
def test_keep_alive_takes_ollamas_forms(value, seconds):
    got = parse_keep_alive(value)
    assert got == pytest.approx(seconds) if seconds is not None and math.isfinite(seconds) else got == seconds


@pytest.mark.parametrize("value", ["10", "5 m", "5d", "m", "", "1h-30m", True, [], {"m": 5}, float("nan"), "ms"])
def test_keep_alive_refuses_what_is_not_a_duration(value):
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)


@pytest.mark.parametrize(
    "now, deadlines, busy, due",
    [
        (100.0, {}, set(), []),
        (100.0, {"a": 99.0, "b": 100.0, "c": 101.0}, set(), ["a", "b"]),  # at the deadline: due
        (100.0, {"a": 99.0, "b": 50.0}, {"a"}, ["b"]),  # a request runs: kept until it ends
        (100.0, {"a": None}, set(), []),  # no deadline: kept for ever
        (1e12, {"z": 1.0, "a": 2.0}, {"q"}, ["a", "z"]),  # sorted; busy ids without deadlines ignored
    ],
)
def test_expired_instances_are_the_idle_ones_past_their_deadline(now, deadlines, busy, due):
    instances = [one_rank_instance(i, keep_until=until) for i, until in deadlines.items()]
    assert expired(now, instances, busy) == due


R, L, F = InstanceStatus.READY, InstanceStatus.LOADING, InstanceStatus.FAILED


@pytest.mark.parametrize(
    "statuses, state",
    [
        ([], None),  # placed, not yet in this node's table
        ([L], None),
        ([L, F], None),  # one still loading
        ([R], True),
        ([F, R], True),  # one ready
        ([F], False),
        ([F, F], False),  # every one failed
    ],
)
def test_a_model_loaded_on_request_is_ready_failed_or_still_loading(statuses, state):
    assert load_state(statuses) is state


class _Node:
    """What :meth:`KeepAlive.end` uses of a node: its background tasks (recorded, not run)."""

    def __init__(self) -> None:
        self.tasks: list[str] = []

    def background(self, coroutine) -> None:
        self.tasks.append(coroutine.__qualname__)
        coroutine.close()


def test_a_request_with_a_keep_alive_asks_for_its_deadline_when_it_ends():
    keep, node = KeepAlive(), _Node()
    keep.begin(["a"])
    keep.begin(["a", "b"])
    keep.end(node, ["a", "b"], 60.0)  # type: ignore[arg-type]
    assert keep.running == {"a": 1} and node.tasks == ["keep"]
    keep.end(node, ["a"], None)  # type: ignore[arg-type]  # absent keep_alive: the deadline stays
    assert keep.running == {} and node.tasks == ["keep"]


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0"),
        (999, "999"),
        (12_345, "12K"),
        (134_515_008, "134.52M"),
        (135_000_000, "135M"),
        (7_615_616_512, "7.6B"),
        (8_000_000_000, "8B"),
    ],
)
def test_parameter_size_is_written_as_ollama_writes_it(n, text):
    assert human_number(n) == text


@pytest.mark.parametrize(
    "file_type, name, level",
    [
        (3, "SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        (15, "x.gguf", "Q4_K_M"),
        (7, "x.gguf", "Q8_0"),
        (0, "x.gguf", "F32"),
        (1, "x.gguf", "F16"),
        (32, "x.gguf", "BF16"),
        (None, "qwen2.5-0.5b-instruct-q4_k_m.gguf", "Q4_K_M"),
        (None, "model-f16.gguf", "F16"),
        (None, "model.gguf", "unknown"),
        (99999, "tiny-Q8_0.gguf", "Q8_0"),
    ],
)
def test_gguf_quantization_from_file_type_else_the_name(file_type, name, level):
    assert gguf_quantization(file_type, name) == level


@pytest.mark.parametrize(
    "dtype, level",
    [("bfloat16", "BF16"), ("float16", "F16"), ("float32", "F32"), (None, "unknown"), ("int8", "unknown")],
)
def test_safetensors_quantization_is_its_dtype(dtype, level):
    assert dtype_quantization(dtype) == level


SMOLLM2_135M = {
    "architecture": "llama",
    "num_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_heads": 9,
    "num_kv_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
}
# Qwen3-30B-A3B's config.json as ModelConfig reads it (experts 768 wide): Qwen's published
# size is 30.5B parameters, 3.3B of them active.
QWEN3_30B_A3B = dict(
    SMOLLM2_135M,
    architecture="qwen3moe",
    num_layers=48,
    hidden_size=2048,
    intermediate_size=768,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=False,
    num_experts=128,
    num_experts_per_tok=8,
    qk_norm=True,
)


def test_parameter_count_of_smollm2_135m_matches_its_published_size():
    assert parameter_count(SMOLLM2_135M) == 134_515_008  # Hugging Face's count for the model
    untied = parameter_count(dict(SMOLLM2_135M, tie_word_embeddings=False))
    assert untied - parameter_count(SMOLLM2_135M) == 49152 * 576


def test_parameter_count_of_a_mixture_of_experts_counts_every_expert():
    assert round(parameter_count(QWEN3_30B_A3B) / 1e9, 1) == 30.5


def test_digest_is_stable_and_changes_with_any_file():
    files = [{"path": "a.gguf", "size": 10, "sha256": "00" * 32, "weights": True}]
    digest = manifest_digest("org/m", "gguf", files)
    assert len(digest) == 64 and digest == manifest_digest("org/m", "gguf", [dict(f) for f in files])
    for other in (
        manifest_digest("org/m", "gguf", [dict(files[0], sha256="11" * 32)]),
        manifest_digest("org/m", "gguf", [dict(files[0], size=11)]),
        manifest_digest("org/n", "gguf", files),
    ):
        assert other != digest


def test_show_texts_name_the_defaults_and_template():
    params = default_parameters(2048)
    assert params == {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "num_ctx": 2048}
    assert parameters_text(params).splitlines()[0] == "temperature" + " " * 20 + "0.8"
    modelfile = modelfile_text("org/m", "{{ messages }}", params)
    assert "FROM org/m\n" in modelfile and 'TEMPLATE """{{ messages }}"""' in modelfile
    assert "PARAMETER num_ctx 2048" in modelfile


@pytest.mark.parametrize(
    "template, caps",
    [
        (None, ["completion"]),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", ["completion"]),
        ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}", ["completion", "tools"]),
    ],
)
def test_capabilities_say_tools_where_the_template_renders_them(template, caps):
    assert capabilities(template) == caps


M = "org/m"


@pytest.mark.parametrize(
    "api, body, param, words",
    [
        ("openai", {"model": M, "messages": [{"role": "user", "content": []}]}, "messages.0.content", "empty"),
        (
            "openai",
            {
                "model": M,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "see"},
                            {"type": "image_url", "image_url": {"url": "data:"}},
                        ],
                    },
                ],
            },
            "messages.1.content.1",
            "model 'org/m' takes text only",
        ),
        (
            "openai",
            {"model": M, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages.0.content.0",
            "takes text only",
        ),
        ("anthropic", {"model": M, "messages": [{"role": "user", "content": []}]}, "messages.0.content", "empty"),
        (
            "anthropic",
            {"model": M, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0",
            "model 'org/m' takes text only",
        ),
        (
            "ollama",
            {"model": M, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
            "messages.0.images",
            "model 'org/m' takes text only",
        ),
        ("ollama", {"model": M, "prompt": "hi", "images": ["aGk="]}, "images", "takes text only"),
    ],
)
def test_content_parts_refused_name_the_part(api, body, param, words):
    with pytest.raises(APIError) as caught:
        check_parts(body, api)
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message


@pytest.mark.parametrize(
    "api, body",
    [
        ("openai", {"model": M, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
        ("openai", {"model": M, "messages": [{"role": "assistant", "content": None}]}),
        ("openai", "not an object"),  # left to the request model's validation
        ("anthropic", {"model": M, "messages": [{"role": "user", "content": "hi"}]}),
        ("ollama", {"model": M, "messages": [{"role": "user", "content": "hi", "images": []}]}),
        ("ollama", {"model": M, "messages": []}),
    ],
)
def test_text_content_passes(api, body):
    check_parts(body, api)


@pytest.mark.parametrize(
    "given, kept",
    [
        ("abc-123", True),
        ("x" * 128, True),
        ("a b", True),
        ("~!@#$%^&*()", True),
        (None, False),
        ("", False),
        ("x" * 129, False),
        ("é", False),
        ("a\tb", False),
        (" a", False),
        ("a\x7f", False),
    ],
)
def test_request_id_keeps_a_clients_short_printable_id(given, kept):
    assert request_id(given, new=lambda: "NEW") == (given if kept else "NEW")


@pytest.mark.parametrize(
    "sets, value",
    [
        ([{"GET"}, {"POST"}], "GET, POST"),
        ([{"HEAD", "GET"}], "GET, HEAD"),
        ([], ""),
        ([{"GET"}, {"get", "DELETE"}], "DELETE, GET"),
    ],
)
def test_allow_lists_every_matching_routes_methods(sets, value):
    assert allow_value(sets) == value


@pytest.mark.parametrize(
    "body, message",
    [
        (error_body(API.CLUSTER, 404, "no instance x", "instance_id"), "no instance x"),
        (error_body(API.OLLAMA, 400, "bad"), "bad"),
        ({"detail": "old"}, "old"),
        ({}, None),
        ("text", None),
    ],
)
def test_error_message_reads_every_shape(body, message):
    assert error_message(body) == message


def test_cluster_errors_have_openais_shape():
    assert error_body(API.CLUSTER, 409, "no room", "nodes") == {
        "error": {"message": "no room", "type": "invalid_request_error", "param": "nodes", "code": None}
    }
    assert error_body(API.CLUSTER, 503, "later")["error"]["type"] == "server_error"
    assert error_body(API.INTERNAL, 404, "x") == {"detail": "x"}
