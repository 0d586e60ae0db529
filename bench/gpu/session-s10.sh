#!/usr/bin/env bash
# The H200 session 10 (issue 11: do GPU-side speedups given to BOTH sides widen the worker's
# lead?): bench/gpu/session.sh with its results in /tmp/s10, the commands bench/HISTORY.md gives.
exec env RES=/tmp/s10 bash "$(dirname "${BASH_SOURCE[0]}")/session.sh" "$@"
