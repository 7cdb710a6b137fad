#!/usr/bin/env bash
# One command on a fresh machine: set up .venv, then run the whole system on embedded defaults
# (local Redis or one it starts, SQLite, the generated local model, a worker, the API, Flower).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/inferq up "$@"
