#!/usr/bin/env bash
# Install everything and run the whole suite: lint, format check, type check, tests.
# This is the README's test command and exactly what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test
scripts/ensure-postgres.sh
scripts/ensure-redis.sh
echo "== ruff"
.venv/bin/ruff check src tests bench
.venv/bin/ruff format --check src tests bench
echo "== mypy --strict"
.venv/bin/mypy
echo "== pytest"
.venv/bin/pytest -q "$@"
