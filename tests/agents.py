"""The coding agents of issue 41 (Claude Code, Codex CLI, opencode, aider, llm), installed
for tests/test_agents_live_e2e.py and run there non-interactively.

Versions are pinned in pyproject.toml's ``[tool.shardline.test-clients]`` (and only there).
Each client is installed once into ``~/.cache/shardline/test-clients/NAME-VERSION`` (outside
the repository) and re-used while its ``.complete`` mark is there: npm packages with
``--ignore-scripts`` (their native binary comes in the platform package npm picks as an
optional dependency, e.g. ``@openai/codex-linux-x64``), PyPI packages into a venv of their
own. An install that fails or runs out of time skips its client's test with the install
output's last line.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "shardline" / "test-clients"
INSTALL_TIMEOUT_S = 600
PACKAGES = {
    "claude": ("npm", "@anthropic-ai/claude-code"),
    "codex": ("npm", "@openai/codex"),
    "opencode": ("npm", "opencode-ai"),
    "aider": ("pypi", "aider-chat"),
    "llm": ("pypi", "llm"),
}
"""Each client's registry and package."""
NATIVE = {
    "claude": "@anthropic-ai/claude-code-{os}-{arch}*/claude",
    "codex": "@openai/codex-{os}-{arch}*/vendor/*/bin/codex",
    "opencode": "opencode-{os}-{arch}*/bin/opencode",
}
"""Where an npm client's native binary lies under ``node_modules`` (a glob: npm installs the
platform package that fits the machine, e.g. ``opencode-linux-x64`` and its
``-baseline`` build for CPUs without AVX2)."""
QUIET = {
    "claude": {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1"},
    "codex": {},
    "opencode": {
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
    },
    "aider": {"LITELLM_LOCAL_MODEL_COST_MAP": "True"},  # no price list from GitHub at start
    "llm": {},
}
"""The offline and no-telemetry variables each client is run with besides its connection's
(tests/fixtures/clients/README.md)."""


def pins() -> dict[str, dict[str, str]]:
    """pyproject.toml's ``[tool.shardline.test-clients]``: {"npm"|"pypi": {package: version}}."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["shardline"]["test-clients"]


def _node_platform() -> tuple[str, str] | None:
    """npm's (os, cpu) names for this machine, or None where no client ships a binary."""
    system = {"linux": "linux", "darwin": "darwin"}.get(sys.platform)
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    return (system, arch) if system and arch else None


def run_bounded(argv: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a session of its own whose every process is killed when
    ``timeout_s`` passes (then the return code is -9 and stderr says so)."""
    proc = subprocess.Popen(
        argv,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[killed after {timeout_s} s]"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _reason(text: str) -> str:
    """Why an install failed, in one line: npm's first error line that says what happened
    (its last ones point at its log, or dump the error object), else the output's last
    line (pip's ``ERROR: ...``)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [
        line
        for line in lines
        if line.startswith("npm error ")
        and line.split()[2].rstrip(":") not in ("code", "syscall", "errno", "path", "A", "at")
    ]
    return said[0] if said else lines[-1] if lines else "(no output)"


def install(client: str) -> Path:
    """The folder holding ``client``'s executable (named as its connection's command names
    it), installed at its pinned version when not yet in the cache; skips the calling test
    where it cannot be installed or has no binary for this machine."""
    kind, package = PACKAGES[client]
    version = pins()[kind][package]
    target = CACHE / f"{package.lstrip('@').replace('/', '+')}-{version}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time per client, across runs
        if not (target / ".complete").exists():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            if kind == "npm":
                npm = shutil.which("npm")
                if npm is None:
                    pytest.skip(f"{package}@{version}: npm is not installed")
                (target / "package.json").write_text('{"private": true}\n')
                # one retry, soon: without the registry an install fails in seconds, not minutes
                argv = [
                    npm,
                    "install",
                    "--ignore-scripts",
                    "--no-audit",
                    "--no-fund",
                    "--no-update-notifier",
                    "--fetch-retries=1",
                    "--fetch-retry-mintimeout=2000",
                    "--fetch-retry-maxtimeout=10000",
                    "--prefix",
                    str(target),
                    f"{package}@{version}",
                ]
                done = run_bounded(argv, INSTALL_TIMEOUT_S)
            else:
                done = run_bounded([sys.executable, "-m", "venv", str(target / "venv")], 120)
                if done.returncode == 0:
                    done = run_bounded(
                        [
                            str(target / "venv" / "bin" / "python"),
                            "-m",
                            "pip",
                            "install",
                            "-q",
                            "--retries",
                            "1",
                            f"{package}=={version}",
                        ],
                        INSTALL_TIMEOUT_S,
                    )
            (target / "install.log").write_text(done.stdout + done.stderr)
            if done.returncode != 0:
                pytest.skip(
                    f"{package}=={version} did not install (exit {done.returncode}): "
                    f"{_reason(done.stdout + done.stderr)}"
                )
            (target / ".complete").write_text(f"{package}=={version}\n")
    if kind == "pypi":
        return target / "venv" / "bin"
    where = _node_platform()
    if where is None:
        pytest.skip(f"{package}@{version} ships no native binary for {sys.platform}/{platform.machine()}")
    found = sorted((target / "node_modules").glob(NATIVE[client].format(os=where[0], arch=where[1])))
    for binary in found:  # the first that starts here (the -baseline build sorts after the other)
        if run_bounded([str(binary), "--version"], 60).returncode == 0:
            return binary.parent
    pytest.skip(
        f"{package}@{version}: no native binary for {where[0]}-{where[1]} starts here "
        f"(found {[str(b.relative_to(target)) for b in found]})"
    )


@dataclass
class Run:
    """One client run: its exit code, output and wall time."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float


def run_client(
    argv: list[str], bin_dir: Path, env: dict[str, str], home: Path, cwd: Path, timeout_s: float = 120.0
) -> Run:
    """Run ``argv`` (its first word found in ``bin_dir``) in ``cwd`` with only a minimal
    environment (``PATH``, ``HOME``, ``TERM=dumb``) plus ``env``, and stdin from /dev/null."""
    full = {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "TERM": "dumb",
        "LANG": "C.UTF-8",
        **env,
    }
    start = time.monotonic()
    done = run_bounded(argv, timeout_s, env=full, cwd=cwd, stdin=subprocess.DEVNULL)
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - start)
