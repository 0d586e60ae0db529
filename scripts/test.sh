#!/usr/bin/env bash
# Lint, type-check, then run the test suite against .venv (run scripts/setup.sh first).
#
# `scripts/test.sh lint` stops after the static checks; `scripts/test.sh fast` runs ruff and the
# tests that need neither the broker nor the engine. Extra arguments go to pytest.
# pytest's exit status 5 means "no tests collected": a green run that tested nothing is a failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BIN=.venv/bin
lint_only=false
fast=false
if [[ "${1:-}" == "lint" ]]; then
    lint_only=true
    shift
elif [[ "${1:-}" == "fast" ]]; then
    # The inner loop: ruff and the tests that need neither the broker nor the engine (mypy and
    # the integration tests are left to `make test`, which CI runs).
    fast=true
    shift
fi

echo "test: ruff check"
"$BIN/ruff" check .
echo "test: ruff format --check"
"$BIN/ruff" format --check .
if $fast; then
    echo "test: pytest (fast tier: not integration)"
    exec "$BIN/python" -m pytest -q -m "not integration" "$@"
fi
echo "test: mypy"
# schemas/ and preprocess/ are distribution roots, each package one folder down, so an import
# path names a real folder; pyproject's mypy_path lists the roots and mypy reads the tree as is.
"$BIN/mypy" -p mmworker -p mmworker_schemas -p mmworker_preprocess
if $lint_only; then
    exit 0
fi

echo "test: pytest"
rc=0
# The slowest tests: CI must finish in 30 min on a 2-core machine, and this shows what to trim.
"$BIN/python" -m pytest -q --durations=20 "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "test: FAILED: pytest collected no tests" >&2
fi
exit "$rc"
