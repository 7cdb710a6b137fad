#!/usr/bin/env bash
# One command: set up .venv, make sure Redis and PostgreSQL are there, lint, type-check, and run
# every test (unit, integration on SQLite and PostgreSQL with the real worker and engine, e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/services.sh
if [ -z "${INFERQ_TEST_POSTGRES_URL:-}" ] \
  && ! psql -h 127.0.0.1 -U postgres -d postgres -tc "SELECT 1" >/dev/null 2>&1; then
  export INFERQ_TEST_POSTGRES_URL="postgresql://postgres:postgres@127.0.0.1:5432/postgres"
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/pytest "$@"
