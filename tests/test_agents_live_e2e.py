"""The coding agents people use work unmodified (issue 41): each real client (Claude Code,
Codex CLI, opencode, aider, llm) runs, non-interactively, against a node with exactly the
settings ``shardline connect CLIENT`` prints (:func:`shardline.connect.connection`: its
environment, its files written under a throwaway HOME or into the project folder, its
command), plus only the offline and no-telemetry variables of
tests/fixtures/clients/README.md (:data:`agents.QUIET`), exits 0 and shows the model's
answer.

The node serves a tiny random-weight model (tests/tiny_chat.py, ``says``) that answers one
word, :data:`tiny_chat.SAYS_WORD`, whatever it is asked, at any temperature, then ends
the turn; it is placed with a context of 65,536 tokens (the clients' prompts are 8-19
thousand tokens and the connection tells them to ask for 16,384 more).

The clients are installed at the versions pinned in pyproject.toml (tests/agents.py), once,
outside the repository; where one cannot be installed its test is skipped with the reason.

How each connection's (interactive) command is run non-interactively, on :data:`PROMPT`:

- claude: ``claude -p PROMPT``
- codex: ``codex exec --skip-git-repo-check PROMPT``
- opencode: ``opencode run PROMPT``
- aider: the command, then ``--message PROMPT --yes-always --no-git --no-check-update
  --no-show-model-warnings --analytics-disable --no-pretty --no-fancy-input``
- llm: the command with PROMPT in place of its example prompt

Then each does a task (:data:`TASKS`): it creates hello.txt with its own tool (aider: with
its edit format), the way a user's agent does work. The node serves, for each client, a
scripted model (tests/scripted_model.py) that calls the client's file-writing tool with
arguments the test chose, and answers "Done." once the tool's result is back; with the
permission setting a non-interactive run needs (``--permission-mode acceptEdits`` for
Claude Code, ``--sandbox workspace-write`` for Codex: docs/clients/), the client runs the
tool, sends its result, prints the answer and exits 0, and the file is there.

And each of Claude Code, Codex and opencode continues its conversation (:data:`TURNS`):
its second turn re-sends the whole first turn, which the node's prefix cache
(src/shardline/runner/prefix_cache.py) holds, so it prefills little more than the answer
and the new message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from agents import QUIET, install, run_client
from conftest import free_port_block
from scripted_model import tool_call_text, write_scripted_model
from tiny_chat import SAYS_WORD, write_tiny_chat_model

from shardline.connect import CLIENTS, Connection, connection
from shardline.local_cluster import LocalCluster

MODEL = "agent"
CONTEXT = 65536
WORD = SAYS_WORD[0]
PROMPT = "Create a file named hello.txt containing the word hi."
CLIENT_TIMEOUT_S = 120
WALL: dict[str, float] = {}
"""Each client run's wall time, printed at the end of the module."""
HITS: dict[str, str] = {}
"""Each client's second turn's cached and prompt tokens, and its first turn's prompt
tokens, printed at the end of the module."""

pytestmark = pytest.mark.timeout(CLIENT_TIMEOUT_S + 2 * 600 + 60)  # an install, the run, the node's start


CALLER = "caller"
CALL = '{"name":"hello","parameters":{}}'
"""What :data:`CALLER` answers, whatever it is asked: a call of a tool ``hello`` with no
arguments, written as a bare JSON object (a form Qwen2.5 falls back to under
``tool_choice: auto``, which shardline takes as a call of a declared tool); its tokens
are all different, as a ``says`` model needs."""


@dataclass
class Node:
    """The module's node: its URL, its log folder (and its models' folder under it), and
    its cluster, to place more models on."""

    url: str
    root: Path
    cluster: LocalCluster


@pytest.fixture(scope="module")
def node(tmp_path_factory, request):
    """The node, serving :data:`MODEL` (says :data:`WORD`) and :data:`CALLER` (says
    :data:`CALL`)."""
    from shardline.models.store import default_model_path
    from shardline.models.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("agents")
    write_tiny_chat_model(root / "models" / MODEL, "qwen", context=CONTEXT, says=(SAYS_WORD[1],))
    call = tuple(Tokenizer(default_model_path()).encode(CALL, add_special_tokens=False))
    write_tiny_chat_model(root / "models" / CALLER, "qwen", context=4096, says=call)
    cluster = LocalCluster(
        nodes=1,
        base_port=free_port_block(1),
        runner_threads=1,
        log_dir=str(root),
        data_dir=str(root),
        model_dirs=[root / "models"],
    )
    cluster.start()
    try:
        cluster.place(str(root / "models" / MODEL), "pipeline", context=CONTEXT, max_batch=2)
        cluster.place(str(root / "models" / CALLER), "pipeline", context=4096, max_batch=2)
        yield Node(cluster.url(0), root, cluster)
    finally:
        cluster.stop()
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if capture is not None and WALL:
            with capture.global_and_fixture_disabled():
                print("\nagents' wall times: " + ", ".join(f"{c} {s:.1f} s" for c, s in WALL.items()))
                if HITS:
                    print("second turns' cached prompt tokens: " + ", ".join(f"{c} {hit}" for c, hit in HITS.items()))


NON_INTERACTIVE = {
    "claude": lambda command: [*command, "-p", PROMPT],
    "codex": lambda command: [*command, "exec", "--skip-git-repo-check", PROMPT],
    "opencode": lambda command: [*command, "run", PROMPT],
    "aider": lambda command: [
        *command,
        "--message",
        PROMPT,
        "--yes-always",
        "--no-git",
        "--no-check-update",
        "--no-show-model-warnings",
        "--analytics-disable",
        "--no-pretty",
        "--no-fancy-input",
    ],
    "llm": lambda command: [*command[:-1], PROMPT],
}
"""Each connection's command with the arguments that run it once on PROMPT and exit."""


def _setup(
    client: str, url: str, tmp_path: Path, model: str = MODEL, context: int = CONTEXT
) -> tuple[Connection, Path, Path]:
    """The connection of ``client`` to ``model``, and a fresh HOME and project folder with
    its files."""
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    conn = connection(client, url, model, context)
    for name, content in conn.files.items():
        path = home / name[2:] if name.startswith("~/") else project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return conn, home, project


def _failure(client: str, run, log_dir: Path) -> str:
    log = (log_dir / "node-0.log").read_text(errors="replace").splitlines()
    return (
        f"{client}: exit {run.returncode} after {run.wall_s:.1f} s\n--- stdout\n{run.stdout[-3000:]}\n"
        f"--- stderr\n{run.stderr[-3000:]}\n--- node log (last 40 lines)\n" + "\n".join(log[-40:])
    )


@pytest.mark.parametrize("client", CLIENTS)
def test_an_agent_runs_against_a_node_with_the_connect_settings(client, node, tmp_path):
    """The client, installed at its pinned version and given only what ``shardline connect``
    prints, sends its real requests (8-19 thousand tokens of system prompt and tools,
    streamed) to the node, gets the model's answer, prints it and exits 0 without a
    traceback."""
    log_dir = node.root
    bin_dir = install(client)
    conn, home, project = _setup(client, node.url, tmp_path)
    run = run_client(
        NON_INTERACTIVE[client](list(conn.command)),
        bin_dir,
        {**QUIET[client], **conn.env},
        home,
        project,
        CLIENT_TIMEOUT_S,
    )
    WALL[client] = run.wall_s
    assert run.returncode == 0, _failure(client, run, log_dir)
    assert WORD in run.stdout, _failure(client, run, log_dir)
    assert "Traceback" not in run.stdout + run.stderr, _failure(client, run, log_dir)


HELLO = """
def hello() -> str:
    "Write hi to hello.txt."
    open("hello.txt", "w").write("hi")
    return "written"
"""


def test_llm_runs_the_tool_the_model_calls(node, tmp_path):
    """A tool round trip through a real client: llm offers a Python function ``hello``
    (``--functions``) with its request; the model answers a call of it; llm runs it (the
    file is written) and sends the result back with the conversation, which the node
    renders and answers again. :data:`CALLER` cannot read the result, so it calls again
    each time, until llm's chain limit (5 responses) ends the run with exit status 1."""
    log_dir = node.root
    bin_dir = install("llm")
    conn, home, project = _setup("llm", node.url, tmp_path, CALLER, 4096)
    argv = [*conn.command[:-1], "--functions", HELLO, "--tools-debug", "Create hello.txt"]
    run = run_client(argv, bin_dir, {**QUIET["llm"], **conn.env}, home, project, CLIENT_TIMEOUT_S)
    WALL["llm tool round trip"] = run.wall_s
    assert (project / "hello.txt").read_text() == "hi", _failure("llm", run, log_dir)
    output = run.stdout + run.stderr
    # 5 responses, each a call: the first 4 run, each result sent back and answered
    assert output.count("Tool call: hello({})") == 4 and "Chain limit of 5 exceeded" in output, _failure(
        "llm", run, log_dir
    )
    assert "Traceback" not in output, _failure("llm", run, log_dir)


TASK_CONTEXT = 32768
AFTER_RESULT = "Done."


@dataclass(frozen=True)
class Task:
    """A client's task of creating hello.txt with what it edits files by: what the model
    writes first (given the project folder), the client's command run on PROMPT (with the
    setting that lets it write without asking), what the file holds after, and what the
    client prints."""

    first: Callable[[Path], str]
    argv: Callable[[list[str]], list[str]]
    content: str
    prints: str = AFTER_RESULT


TASKS = {
    "claude": Task(
        lambda project: tool_call_text("Write", {"file_path": str(project / "hello.txt"), "content": "hi"}),
        lambda command: [*command, "-p", PROMPT, "--permission-mode", "acceptEdits"],
        "hi",
    ),
    "codex": Task(
        lambda project: tool_call_text("exec_command", {"cmd": "echo hi > hello.txt"}),
        lambda command: [*command, "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", PROMPT],
        "hi\n",
    ),
    "opencode": Task(
        lambda project: tool_call_text("write", {"filePath": str(project / "hello.txt"), "content": "hi"}),
        NON_INTERACTIVE["opencode"],
        "hi",
    ),
    "aider": Task(
        lambda project: "hello.txt\n```\nhi\n```", NON_INTERACTIVE["aider"], "hi\n", "Applied edit to hello.txt"
    ),
    "llm": Task(
        lambda project: tool_call_text("hello", {}), lambda command: [*command[:-1], "--functions", HELLO, PROMPT], "hi"
    ),
}
"""Each agent's task. Claude Code's ``Write`` and opencode's ``write`` take an absolute path;
Codex's ``exec_command`` runs a shell command in the project folder (which ``codex exec``'s
default read-only sandbox would refuse to write); aider has no tools: it writes the files
the model lists in its "whole" edit format (a file name, then the content fenced); llm
runs the Python function :data:`HELLO` it is given."""


@pytest.mark.parametrize("client", TASKS)
def test_an_agent_creates_a_file(client, node, tmp_path):
    """A task through a real client. The node serves a scripted model
    (tests/scripted_model.py) that answers the client's first request with a call of the
    client's own file-writing tool (Claude Code's ``Write``, opencode's ``write``,
    Codex's ``exec_command``; tool_choice auto; the call written as Qwen2.5 writes one,
    after its ``<tool_call>`` token), and once the tool's result is in the prompt answers
    :data:`AFTER_RESULT` and ends. The client runs the tool (the file is there, with its
    content), sends the result back, prints the answer and exits 0. llm's tool is the
    Python function :data:`HELLO`; aider's model answers a file listing, which aider
    writes."""
    task = TASKS[client]
    bin_dir = install(client)
    model = f"task-{client}"
    conn, home, project = _setup(client, node.url, tmp_path, model, TASK_CONTEXT)
    write_scripted_model(node.root / "models" / model, task.first(project), AFTER_RESULT, context=TASK_CONTEXT)
    node.cluster.place(str(node.root / "models" / model), "pipeline", context=TASK_CONTEXT, max_batch=2)
    run = run_client(
        task.argv(list(conn.command)), bin_dir, {**QUIET[client], **conn.env}, home, project, CLIENT_TIMEOUT_S
    )
    WALL[f"{client} task"] = run.wall_s
    failure = _failure(client, run, node.root)
    assert run.returncode == 0, failure
    assert (project / "hello.txt").exists(), failure
    assert (project / "hello.txt").read_text() == task.content, failure
    assert task.prints in run.stdout, failure
    assert "Traceback" not in run.stdout + run.stderr, failure


NEXT = "Say it once more."
TURNS = {
    "claude": (NON_INTERACTIVE["claude"], lambda command: [*command, "-p", "--continue", NEXT]),
    "codex": (
        NON_INTERACTIVE["codex"],
        lambda command: [*command, "exec", "resume", "--skip-git-repo-check", "--last", NEXT],
    ),
    "opencode": (
        lambda command: [*command, "run", "--title", "hello", PROMPT],
        lambda command: [*command, "run", "--continue", NEXT],
    ),
}
"""Each agent's first turn on PROMPT and its second turn, which continues the last
conversation in the project folder with :data:`NEXT`. opencode is given the session's
title (``--title``), else its first turn also asks the model for one (a request of its
own, 0.6 thousand tokens), which the counts below would add to the turn's."""
CACHED_SHARE = 0.95
"""Of the first turn's prompt, the share the second turn must find cached. What it may
miss is under 256 tokens of the 7-12 thousand (6-176 measured with whole-block caching,
when a hit still resumed 96 rows before its chunk's end): a prompt's short last chunk is
not cached (:func:`~shardline.runner.prefix_cache.exact_end`), and a prompt that ends in
one resumes at its start (:func:`~shardline.runner.prefix_cache.reuse`)."""


def _served(url: str) -> tuple[float, float, float]:
    """The node's requests, prompt tokens and cached prompt tokens so far (its /metrics:
    the counts of finished requests, the cached ones as their usage reports them)."""
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    requests = sum(v for k, v in samples.items() if k.startswith("shardline_requests_total{"))
    return requests, samples["shardline_prompt_tokens_total"], samples["shardline_cached_prompt_tokens_total"]


def _served_since(url: str, before: tuple[float, float, float], wait_s: float = 10.0) -> tuple[float, float, float]:
    """:func:`_served` once it counts a request more than ``before`` (a request is counted
    as its generation ends, which a client that has exited may have seen a moment before),
    or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while (now := _served(url))[0] <= before[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


@pytest.mark.timeout(2 * CLIENT_TIMEOUT_S + 2 * 600 + 60)  # an install, two runs, the node's start
@pytest.mark.parametrize("client", TURNS)
def test_an_agents_second_turn_hits_the_prefix_cache(client, node, tmp_path):
    """Issue 43: the client, unmodified, runs a turn (one request: 8-12 thousand tokens of
    system prompt, tools and PROMPT), then continues that conversation in a second run
    (one request), which re-sends the first turn with the model's answer and NEXT after
    it. Nothing in the first turn's prompt changes between the two (Claude Code's
    per-request billing header line is left out of the prompt:
    :data:`shardline.api.anthropic_request.VOLATILE_LINE`), so the second turn's usage
    reports at least :data:`CACHED_SHARE` of the first turn's prompt as cached."""
    first, second = TURNS[client]
    bin_dir = install(client)
    conn, home, project = _setup(client, node.url, tmp_path)
    env = {**QUIET[client], **conn.env}
    served = [_served(node.url)]
    for turn, argv in enumerate((first, second), 1):
        run = run_client(argv(list(conn.command)), bin_dir, env, home, project, CLIENT_TIMEOUT_S)
        served.append(_served_since(node.url, served[-1]))
        WALL[f"{client} turn {turn}"] = run.wall_s
        failure = _failure(client, run, node.root)
        assert run.returncode == 0, failure
        assert WORD in run.stdout, failure
        assert "Traceback" not in run.stdout + run.stderr, failure
    (requests1, prompt1, _), (requests2, prompt2, cached2) = (
        tuple(after - before for before, after in zip(served[i], served[i + 1])) for i in (0, 1)
    )
    assert requests1 == requests2 == 1, f"{client}: {requests1:.0f} and {requests2:.0f} requests, not one a turn"
    HITS[client] = f"{cached2:.0f} of {prompt2:.0f} (first turn {prompt1:.0f})"
    assert prompt2 > prompt1, f"{client}: the second turn ({prompt2:.0f} tokens) did not continue the first's"
    assert cached2 >= CACHED_SHARE * prompt1, (
        f"{client}: the second turn found {cached2:.0f} of the first turn's {prompt1:.0f} tokens cached"
    )
