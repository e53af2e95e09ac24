#!/usr/bin/env bash
# The one device check: GPU tests, then the GPU benchmarks, on a CUDA machine with only
# torch, transformers and triton installed and no network. Prints one table last.
#   bash bench/device_check.sh [output folder]
# A rerun can skip a part that already ran: SKIP_TESTS=1, SKIP_HYBRID=1, SKIP_BENCH=1, SKIP_QUANT=1, SKIP_KV=1,
# SKIP_LAPTOP=1, SKIP_STRUCTURED=1 or SKIP_SPEC=1.
# Device time is short (one command may run 10 minutes): the parts run in order of importance within
# DEVICE_BUDGET seconds (540 by default), each cut to the time left, and a part with under a minute left is not
# started. The last line names the parts left for a rerun, with the switches that skip the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/pagoda-device-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
budget=${DEVICE_BUDGET:-540}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"

declare -A rc
left_for_rerun=()
# run_part NAME SKIP_SWITCH TIMEOUT LOG TITLE COMMAND...: the part's exit status lands in rc[NAME].
run_part() {
    local name=$1 switch=$2 limit=$3 log=$4 title=$5
    shift 5
    rc[$name]=skipped
    if [ -n "${!switch:-}" ]; then
        return
    fi
    local remaining=$((budget - SECONDS))
    if [ "$remaining" -lt 60 ]; then
        rc[$name]="not run (time)"
        left_for_rerun+=("$switch")
        return
    fi
    [ "$limit" -gt "$remaining" ] && limit=$remaining
    echo "== $title (at most ${limit} s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$log" | grep -vE "^\s*$|Loading weights" | tail -60
    rc[$name]=${PIPESTATUS[0]}
}

run_part tests SKIP_TESTS "${TEST_TIMEOUT:-230}" tests.log "GPU tests" \
    python3 -m pytest tests/gpu -q -p no:cacheprovider -s --durations=8
run_part hybrid SKIP_HYBRID "${HYBRID_TIMEOUT:-150}" hybrid.log \
    "Qwen3.5 (the delta-rule kernels at 4B shapes; batch-1 and 16-chat decode of a 4B-shaped model)" \
    python3 -m bench.gpu_hybrid
run_part bench SKIP_BENCH "${BENCH_TIMEOUT:-240}" bench.log "GPU benchmarks" \
    python3 -m bench.gpu_bench --json "$out/bench.json"
run_part quantized SKIP_QUANT "${QUANT_TIMEOUT:-300}" quantized.log \
    "Quantized weights (int4 Qwen3-8B shape in an 8 GiB budget, against bf16; 0.6B against its reference)" \
    python3 -m bench.gpu_quantized
run_part kv SKIP_KV "${KV_TIMEOUT:-150}" kv.log \
    "Quantized KV cache (decode at a 32k context against auto, Qwen3-0.6B shape; issue 36)" \
    python3 -m bench.kv_cache_dtype --random-qwen3 /tmp/pagoda-random-qwen3 --context 32768 --budget-mib 4096 --rounds 2
run_part laptop SKIP_LAPTOP "${LAPTOP_TIMEOUT:-200}" laptop.log \
    "Laptop GPUs (Qwen3-1.7B and 4B shapes under an 8 GiB cap, with the app's defaults)" \
    python3 -m bench.gpu_laptop
# The device image has no llguidance: bench/prepare_device.sh puts it into .device/site (ignored), carried along.
if [ -z "${SKIP_STRUCTURED:-}" ] && ! PYTHONPATH=$PWD/.device/site:$PYTHONPATH python3 -c "import llguidance" 2>/dev/null; then
    echo "llguidance is not importable: run bash bench/prepare_device.sh before the run and carry .device"
    SKIP_STRUCTURED=1
fi
run_part structured SKIP_STRUCTURED "${STRUCTURED_TIMEOUT:-120}" structured.log \
    "Structured output (a constrained decode step against a free one, batch 1 and 32)" \
    env PYTHONPATH="$PWD/.device/site:$PYTHONPATH" python3 -m bench.structured_output --random-qwen3 /tmp/pagoda-random-qwen3 --tokens 48 --rounds 3

run_part spec SKIP_SPEC "${SPEC_TIMEOUT:-150}" spec.log \
    "Speculative decoding (the model as its own draft, and n-gram drafts that fail, at batch 1 and 16; issue 32)" \
    python3 -m bench.gpu_speculative

echo "device_check: tests exit ${rc[tests]}, hybrid exit ${rc[hybrid]}, benchmarks exit ${rc[bench]}, quantized exit ${rc[quantized]}," \
    "kv exit ${rc[kv]}, laptop exit ${rc[laptop]}, structured exit ${rc[structured]}, spec exit ${rc[spec]} (${SECONDS} s)"
if [ ${#left_for_rerun[@]} -gt 0 ]; then
    skip_done=""
    for switch in SKIP_TESTS SKIP_HYBRID SKIP_BENCH SKIP_QUANT SKIP_KV SKIP_LAPTOP SKIP_STRUCTURED SKIP_SPEC; do
        [[ " ${left_for_rerun[*]} " == *" $switch "* ]] || skip_done+="$switch=1 "
    done
    echo "device_check: out of time for ${left_for_rerun[*]}; rerun with: ${skip_done}bash bench/device_check.sh"
    exit 3
fi
for part in tests hybrid bench quantized kv laptop structured spec; do
    [[ "${rc[$part]}" =~ ^(0|skipped)$ ]] || exit 1
done
