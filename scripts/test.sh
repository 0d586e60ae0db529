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
# schemas/ and preprocess/ install as mmworker.schemas and mmworker.preprocess (pyproject's
# package-dir), through an import hook that mypy does not follow; so mypy reads a tree of links
# laid out as the wheel installs it (build/typeview/mmworker/{schemas,preprocess,...}).
root=$PWD
view=build/typeview
rm -rf "$view"
mkdir -p "$view/mmworker"
for entry in mmworker/*; do
    ln -s "$root/$entry" "$view/mmworker/"
done
ln -s "$root/schemas" "$view/mmworker/schemas"
ln -s "$root/preprocess" "$view/mmworker/preprocess"
(cd "$view" && "$root/$BIN/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p mmworker)
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
