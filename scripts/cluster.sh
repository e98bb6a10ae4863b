#!/usr/bin/env bash
# Starts a local 3-node pipeline cluster serving the embedded default model
# (SmolLM2-135M-Instruct). Extra arguments go to `shardline cluster`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/shardline" cluster "$@"
