#!/usr/bin/env bash
# One command: set up .venv, make sure Redis and PostgreSQL are there, lint, type-check, and run
# every test (unit, integration on SQLite and PostgreSQL with the real worker and engine, e2e,
# the docs build), then the job's lifecycle tests again on stock Celery.
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
.venv/bin/pytest "$@"
# With no test paths given (the whole suite), the job's lifecycle once more on stock Celery: its
# transport, strategy and send_task instead of inferq's adaptations (docs/architecture.md).
for arg in "$@"; do
  case "$arg" in -*) ;; *) exit 0 ;; esac
done
# One SIGKILL there: the kills' count is the main pass's business.
echo "test: the job's lifecycle on stock Celery (INFERQ_CELERY_MODE=stock)"
INFERQ_CELERY_MODE=stock INFERQ_TEST_KILL_TRIALS=1 \
  exec .venv/bin/pytest "$@" -m lifecycle -k "not postgresql" tests/integration
