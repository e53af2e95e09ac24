#!/usr/bin/env bash
# The one device check: GPU tests, then the GPU benchmarks, on a CUDA machine with only
# torch, transformers and triton installed and no network. Prints one table last.
#   bash bench/device_check.sh [output folder]
# A rerun can skip a part that already ran: SKIP_TESTS=1, SKIP_BENCH=1, SKIP_QUANT=1, SKIP_LAPTOP=1 or
# SKIP_STRUCTURED=1.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/pagoda-device-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
tests_rc=skipped bench_rc=skipped
if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== GPU tests"
    timeout ${TEST_TIMEOUT:-230} python3 -m pytest tests/gpu -q -p no:cacheprovider -s --durations=8 2>&1 | tee "$out/tests.log" | grep -vE "^\s*$|Loading weights" | tail -40
    tests_rc=${PIPESTATUS[0]}
fi
if [ -z "${SKIP_BENCH:-}" ]; then
    echo "== GPU benchmarks"
    timeout ${BENCH_TIMEOUT:-240} python3 -m bench.gpu_bench --json "$out/bench.json" 2>&1 | tee "$out/bench.log" | grep -v "Loading weights"
    bench_rc=${PIPESTATUS[0]}
fi
quant_rc=skipped
if [ -z "${SKIP_QUANT:-}" ]; then
    echo "== Quantized weights (int4 Qwen3-8B shape in an 8 GiB budget, against bf16; 0.6B against its reference)"
    timeout ${QUANT_TIMEOUT:-300} python3 -m bench.gpu_quantized 2>&1 | tee "$out/quantized.log" | grep -v "Loading weights"
    quant_rc=${PIPESTATUS[0]}
fi
laptop_rc=skipped
if [ -z "${SKIP_LAPTOP:-}" ]; then
    echo "== Laptop GPUs (Qwen3-1.7B and 4B shapes under an 8 GiB cap, with the app's defaults)"
    timeout ${LAPTOP_TIMEOUT:-200} python3 -m bench.gpu_laptop 2>&1 | tee "$out/laptop.log" | grep -v "Loading weights"
    laptop_rc=${PIPESTATUS[0]}
fi
structured_rc=skipped
if [ -z "${SKIP_STRUCTURED:-}" ]; then
    echo "== Structured output (a constrained decode step against a free one, batch 1 and 32)"
    # The device image has no llguidance: unzip its wheel into .device/site (ignored) and carry that folder.
    if PYTHONPATH=$PWD/.device/site:$PYTHONPATH python3 -c "import llguidance" 2>/dev/null; then
        PYTHONPATH=$PWD/.device/site:$PYTHONPATH timeout ${STRUCTURED_TIMEOUT:-120} python3 -m bench.structured_output \
            --random-qwen3 /tmp/pagoda-random-qwen3 --tokens 48 --rounds 3 2>&1 | tee "$out/structured.log" | grep -v "Loading weights"
        structured_rc=${PIPESTATUS[0]}
    else
        echo "llguidance is not importable: unzip its wheel into .device/site and carry it"
    fi
fi
echo "device_check: tests exit $tests_rc, benchmarks exit $bench_rc, quantized exit $quant_rc, laptop exit $laptop_rc," \
    "structured exit $structured_rc"
[[ "$tests_rc" =~ ^(0|skipped)$ ]] && [[ "$bench_rc" =~ ^(0|skipped)$ ]] && [[ "$quant_rc" =~ ^(0|skipped)$ ]] \
    && [[ "$laptop_rc" =~ ^(0|skipped)$ ]] && [[ "$structured_rc" =~ ^(0|skipped)$ ]]
