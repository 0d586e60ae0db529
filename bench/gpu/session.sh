#!/usr/bin/env bash
# One H200 device session, one stage per device call, every peer file named after the engine
# settings it ran with:
#
#   bash bench/gpu/session.sh probe                                  # front-end CPU per request
#   bash bench/gpu/session.sh peers NAME [--set K=V ...]            # raw ×1, raw ×2 engines, naive
#   bash bench/gpu/session.sh worker NAME PEERS PASSES [--set K=V ...] [--processes N]
#   bash bench/gpu/session.sh compare NAME [--set K=V ...]         # all of it: bench/compare.py
#   bash bench/gpu/session.sh startup KINDS [--set K=V ...]        # bench/startup.py, cold+warm
#   bash bench/gpu/session.sh kernels [--videos N] [--set K=V ...]  # GPU time by kernel family
#
# A worker row must get exactly the --set flags its PEERS file ran with (bench/e2e.py's peers take
# the engine arguments from the same parsed worker config; the JSON's peers.engine_kwargs shows
# them). Every stage keeps its output in $RES (default /tmp/s10; the warm machine keeps /tmp
# between calls) and copies what it wrote there, with the model config bench/mfu.py reads, to
# $OUT, so a stage cut off by the call's time limit still returns what it finished, and the logs
# of its engine and worker runs (gzipped, in $OUT/logs). While a stage runs,
# nvidia-smi samples the GPU's utilisation every 200 ms into $RES/smi-STAGE-NAME.csv. A stage
# exits non-zero when its report is missing or not ok, so a call can fall back to other settings
# (`... || ...`).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export STAGE=${STAGE:-/tmp/stage} VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# vLLM's own INFO lines in the worker's log too (the worker quiets them by default, and then
# its engine start-up is one opaque number: 35 s against a plain engine's 15 s in session 23)
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
# /tmp/mmworker-plugins: the entry-point dist-info bench/gpu/run.sh writes (its comment says why)
export PYTHONPATH=$PWD:$PWD/schemas:$PWD/preprocess:/tmp/mmworker-plugins
# One compile cache for every e2e stage of a lease (vLLM's torch.compile, Inductor, Triton): the
# peers' and the worker's engines compile once per lease, not in every call (session 25's e2e
# call spent its 570 s on the peers' compile). `startup` keeps its own per-kind directories (its
# cold rows need them empty) and adds them here when it ends, so a `peers` call after it starts
# warm (session 26). Rates are counted after start-up, so this changes no rate.
cc=${COMPILE_CACHE:-/tmp/compile-cache}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$cc/vllm_cache_root}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$cc/triton_cache_dir}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$cc/torchinductor_cache_dir}
res=${RES:-/tmp/s10}
mkdir -p "$res" "${OUT:-bench/out}"
model=/tmp/qwen2.5-vl-3b-dummy
smi=
# Only what this stage wrote goes back (files newer than this mark): a call returns at most 8
# files, and copying all of $res, which the warm machine keeps between calls, left session 31's
# worker reports behind once earlier stages' files had filled those 8.
mark=$(mktemp)
finish() {
    [[ -n $smi ]] && kill "$smi" 2>/dev/null
    local out=${OUT:-bench/out} f rel
    while IFS= read -r f; do
        rel=${f#"$res"/}
        mkdir -p "$out/$(dirname "$rel")"
        cp "$f" "$out/$rel"
    done < <(find "$res" -type f -newer "$mark")
    cp "$model/config.json" "$out/model-config.json" 2>/dev/null
    find bench/out -maxdepth 1 -name 'profile-*.txt' -newer "$mark" -exec cp {} "$out"/ \; 2>/dev/null
    # The engines' and workers' logs of this stage (start-up steps with their times), gzipped:
    # they show where a start-up's minutes go, which the reports give only as one number.
    for f in /tmp/e2e/*.log; do
        if [[ -f $f && $f -nt $mark ]]; then
            mkdir -p "$out/logs"
            gzip -c "$f" >"$out/logs/$(basename "$f").gz"
        fi
    done
    rm -f "$mark"
    true
}
trap finish EXIT
# No worker setting is pinned here: left out, `processes`, `limits.max_in_flight` (1,024 on this
# GPU; sessions up to 16 set it by hand) and the compiled vision encoder are the worker's own
# choice for the host, and the encoder flag reaches the peers' engines too (bench/peers/raw.py).
R=(bash bench/gpu/run.sh --images 1000 --videos 100 --work-dir /tmp/e2e)
stage=${1:?stage}
shift

ok() {  # the report exists and bench/e2e.py called it ok
    python3 -c "import json, sys; d = json.load(open('$1')); sys.exit(0 if d.get('ok') and not d.get('partial') else 1)" \
        2>/dev/null
}

sample_gpu() {  # $1: file
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=timestamp,utilization.gpu,utilization.memory,memory.used \
            --format=csv,noheader -lms 200 >"$1" 2>/dev/null &
        smi=$!
    fi
}

case $stage in
probe)
    SETUP_ONLY=1 bash bench/gpu/run.sh  # the bundle, the model config; nothing measured
    python3 bench/gpu/frontend_probe.py --model "$model" --out "$res/probe.json" "$@" 2>&1 |
        grep -v " INFO \| WARNING " | tail -60
    ;;
peers)
    name=${1:?name}
    shift
    sample_gpu "$res/smi-peers-$name.csv"
    "${R[@]}" --raw-repeats 1 --naive-images 40 --naive-videos 4 --raw-engines 2 --passes "" \
        "$@" --out "$res/peers-$name.json" 2>&1 | tail -40
    ok "$res/peers-$name.json"
    ;;
worker)
    name=${1:?name}
    peers=${2:?peers}
    passes=${3:?passes}
    shift 3
    sample_gpu "$res/smi-worker-$name.csv"
    "${R[@]}" --skip-raw --skip-naive --peers-from "$res/peers-$peers.json" \
        --passes "$passes" "$@" --out "$res/worker-$name.json" 2>&1 | tail -30
    ok "$res/worker-$name.json"
    ;;
compare)  # peers, worker cold ×2, warm, peers; call again to go on (--resume keeps what is done)
    name=${1:?name}
    shift
    SETUP_ONLY=1 bash bench/gpu/run.sh
    sample_gpu "$res/smi-compare-$name-$(date +%H%M%S).csv"  # one per call
    python3 bench/compare.py --name "compare-$name" --out-dir "$res" --config "$model/config.json" \
        --resume --model "$model" --load-format dummy --max-tokens 64 --max-model-len 8192 \
        --no-profile --images 1000 --videos 100 --work-dir /tmp/e2e --raw-repeats 1 \
        --naive-images 40 --naive-videos 4 "$@" 2>&1 | grep -v " INFO \| WARNING " | tail -60
    ok "$res/compare-$name.json"
    ;;
startup)  # bench/startup.py: KINDS (comma list) cold then warm; again with other KINDS adds rows
    kinds=${1:?kinds}
    shift
    SETUP_ONLY=1 bash bench/gpu/run.sh
    # The caches stay out of $res (finish copies $res back); the logs come back gzipped.
    python3 bench/startup.py --model "$model" --load-format dummy --max-model-len 8192 \
        --kinds "$kinds" --work-dir /tmp/startup --out "$res/startup.json" "$@" 2>&1 |
        grep -v " INFO \| WARNING " | tail -30
    mkdir -p "$res/startup-logs" "$cc"
    for f in /tmp/startup/*/*.log; do
        gzip -c "$f" >"$res/startup-logs/$(basename "$(dirname "$f")")-$(basename "$f").gz"
    done
    for d in /tmp/startup/*/compile; do  # vllm_cache_root, triton_cache_dir, ...: see above
        [[ -d $d ]] && cp -rn "$d"/. "$cc"/
    done
    ;;
kernels)  # bench/kernel_profile.py: one plain engine's GPU time by kernel on a batch of clips
    SETUP_ONLY=1 bash bench/gpu/run.sh
    sample_gpu "$res/smi-kernels.csv"
    # The traces (large) stay on the machine; the summary comes back. Writing a trace when the
    # profiler stops can outlast vLLM's RPC timeout (its profiling docs raise it the same way).
    VLLM_RPC_TIMEOUT=1800000 python3 bench/kernel_profile.py --model "$model" \
        --load-format dummy --max-model-len 8192 --out-dir /tmp/kernels "$@" 2>&1 | grep -v " INFO \| WARNING " | tail -60
    cp /tmp/kernels/kernel-profile.json "$res/kernel-profile.json"
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
