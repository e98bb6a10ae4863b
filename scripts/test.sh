#!/usr/bin/env bash
# Runs the test suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
# The dashboard's browser test drives Debian's chromium; without it that test is skipped.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing chromium for the dashboard's browser test" >&2
    { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null 2>&1 \
        || echo "could not install chromium: the dashboard's browser test will be skipped" >&2
fi
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q "$@"
