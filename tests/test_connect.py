"""``shardline connect`` (:mod:`shardline.connect`): each client's settings name the node,
the model and a context that leaves the client's own requests room, in files its parser
reads."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from shardline.connect import AGENT_PROMPTS, CLIENTS, NO_KEY, connection, output_tokens

pytestmark = pytest.mark.fast

URL, MODEL = "http://10.0.0.2:52415", "qwen2.5-7b-instruct-q4_k_m"


@pytest.mark.parametrize("context,out", [(2048, 512), (8192, 2048), (32768, 8192), (200_000, 32_000), (512, 256)])
def test_output_tokens_leave_the_prompt_three_quarters(context, out):
    assert output_tokens(context) == out


@pytest.mark.parametrize(
    "client, context, out, fits",
    [
        ("opencode", 8192, 256, True),  # SmolLM2's context: half what its 7.8 thousand leave, not 2,048
        ("codex", 8192, 256, False),
        ("claude", 8192, 256, False),
        ("opencode", 12288, 2244, True),
        ("opencode", 16384, 4096, True),
    ],
)
def test_an_agents_output_leaves_room_for_its_own_prompt(client, context, out, fits):
    settings = connection(client, URL, MODEL, context)
    assert output_tokens(context, AGENT_PROMPTS[client]) == out
    assert ("(fits with" in settings.text()) == fits and f"with {out} output tokens" in settings.text()
    if client == "opencode":
        config = json.loads(settings.files["opencode.json"])
        assert config["provider"]["shardline"]["models"][MODEL]["limit"] == {"context": context, "output": out}


def test_claude_code_env():
    env = connection("claude", URL, MODEL, 32768, "k3y").env
    assert env["ANTHROPIC_BASE_URL"] == URL and env["ANTHROPIC_AUTH_TOKEN"] == "k3y"
    assert {env[f"ANTHROPIC_DEFAULT_{size}_MODEL"] for size in ("OPUS", "SONNET", "HAIKU")} == {MODEL}
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "8192"
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in env  # it takes 100,000 at the least
    assert connection("claude", URL, MODEL, 131072).env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "131072"


def test_codex_config_is_toml():
    settings = connection("codex", URL, MODEL, 32768)
    config = tomllib.loads(settings.files["~/.codex/config.toml"])
    assert (config["model"], config["model_provider"], config["model_context_window"]) == (MODEL, "shardline", 32768)
    provider = config["model_providers"]["shardline"]
    assert provider["base_url"] == f"{URL}/v1" and provider["wire_api"] == "responses"
    assert settings.env[provider["env_key"]] == NO_KEY  # a node without a key takes any


def test_opencode_config_is_json():
    config = json.loads(connection("opencode", URL, MODEL, 32768, "k").files["opencode.json"])
    provider = config["provider"]["shardline"]
    assert config["model"] == f"shardline/{MODEL}" and provider["options"] == {"baseURL": f"{URL}/v1", "apiKey": "k"}
    assert provider["models"][MODEL]["limit"] == {"context": 32768, "output": 8192}


def test_aider_metadata_names_the_litellm_model():
    settings = connection("aider", URL, MODEL, 16384)
    metadata = json.loads(settings.files["~/.aider.model.metadata.json"])
    assert metadata[f"openai/{MODEL}"]["max_input_tokens"] + metadata[f"openai/{MODEL}"]["max_output_tokens"] == 16384
    assert settings.command[settings.command.index("--model") + 1] == f"openai/{MODEL}"


@pytest.mark.parametrize("client", CLIENTS)
def test_text_has_every_setting(client):
    settings = connection(client, URL, MODEL, 8192)
    text = settings.text()
    assert all(f"export {name}=" in text for name in settings.env)
    assert all(content.strip() in text for content in settings.files.values())
    assert text.splitlines()[0] == f"# {client}"


def test_an_unknown_client_is_refused():
    with pytest.raises(ValueError, match="cursor"):
        connection("cursor", URL, MODEL, 8192)


DOC_EXAMPLE = ("http://127.0.0.1:52415", "Qwen2.5-Coder-7B-Instruct-Q4_K_M", 32768)
PAGES = Path(__file__).resolve().parent.parent / "docs" / "clients"


@pytest.mark.parametrize("client", CLIENTS)
def test_each_clients_page_shows_what_connect_prints(client):
    """docs/clients/*.md carry the settings of :data:`DOC_EXAMPLE` between their
    ``<!-- connect: CLIENT -->`` markers, as `shardline connect` prints them."""
    pages = {
        m.group(1): m.group(2)
        for page in PAGES.glob("*.md")
        for m in re.finditer(
            r"<!-- connect: (\w+) -->\n```bash\n(.*?)```\n<!-- connect: end -->", page.read_text(), re.S
        )
    }
    assert pages.get(client) == connection(client, *DOC_EXAMPLE).text(), f"update {client}'s page in docs/clients"
