#!/usr/bin/env bash
# Lint, type-check, then run the test suite against .venv (run scripts/setup.sh first).
#
# `scripts/test.sh lint` stops after the static checks. Extra arguments go to pytest.
# pytest's exit status 5 means "no tests collected": a green run that tested nothing is a failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BIN=.venv/bin
lint_only=false
if [[ "${1:-}" == "lint" ]]; then
    lint_only=true
    shift
fi

echo "test: ruff check"
"$BIN/ruff" check .
echo "test: ruff format --check"
"$BIN/ruff" format --check .
echo "test: mypy"
"$BIN/mypy" schemas preprocess mmworker
if $lint_only; then
    exit 0
fi

echo "test: pytest"
rc=0
"$BIN/python" -m pytest -q "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "test: FAILED: pytest collected no tests" >&2
fi
exit "$rc"
