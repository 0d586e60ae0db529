#!/usr/bin/env bash
# H200 session 9 (bench/HISTORY.md, *H200 session 9*), one stage per device call:
#
#   bash bench/gpu/session-s9.sh check                 # pixel-path unit test on this vLLM
#   bash bench/gpu/session-s9.sh peers                 # raw ×1, raw ×2 engines, naive
#   bash bench/gpu/session-s9.sh serve                 # vllm serve, 4 API servers, 4 renderer threads
#   bash bench/gpu/session-s9.sh worker NAME PASSES [--set K=V ...] [--processes N]
#
# Every stage keeps its JSON in /tmp/s9 (the warm machine keeps /tmp between calls) and copies
# all of it to $OUT, so a stage cut off by the call's time limit still returns what it finished.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export STAGE=${STAGE:-/tmp/stage} VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
res=/tmp/s9
mkdir -p "$res" "${OUT:-bench/out}"
trap 'cp -r "$res"/. "${OUT:-bench/out}"/ 2>/dev/null || true' EXIT
R=(bash bench/gpu/run.sh --images 1000 --videos 100 --work-dir /tmp/e2e
   --set limits.max_in_flight=1024)
model=/tmp/qwen2.5-vl-3b-dummy
stage=${1:?stage}
shift
case $stage in
check)
    bash bench/gpu/run.sh --help >/dev/null  # installs the bundle and the package if needed
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>/dev/null
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/unit/test_engine_pixels.py 2>&1 \
        | tail -15 | tee "$res/check.txt"
    ;;
peers)
    "${R[@]}" --raw-repeats 1 --naive-images 40 --naive-videos 4 --raw-engines 2 --passes "" \
        --out "$res/peers.json" 2>&1 | tail -40
    ;;
serve)
    bash bench/gpu/run.sh --help >/dev/null  # installs the bundle and the package if needed
    python3 -c "import vllm.entrypoints.openai.api_server" && \
    python3 bench/peers/serve.py --model "$model" --load-format dummy --images 1000 \
        --videos 100 --max-tokens 64 --max-model-len 8192 --api-servers 4 \
        --renderer-threads 4 --out "$res/serve.json" 2>&1 | tail -12
    cp bench/out/serve-peer.log "$res/" 2>/dev/null
    ;;
worker)
    name=${1:?name}
    passes=${2:?passes}
    shift 2
    serve=()
    [[ -f $res/serve.json ]] && serve=(--serve-from "$res/serve.json")
    "${R[@]}" --skip-raw --skip-naive --peers-from "$res/peers.json" "${serve[@]}" \
        --passes "$passes" "$@" --out "$res/worker-$name.json" 2>&1 | tail -30
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
