#!/usr/bin/env bash
# Before a device run: put what the device image lacks into .device/ (git-ignored), to send along with
# `carry: [".device"]`. The device has torch, transformers and triton, and cannot install packages; the structured
# output part of bench/device_check.sh needs llguidance (an abi3 wheel, so any Python 3.9+ there takes it).
#   bash bench/prepare_device.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_31_x86_64 --python-version 3.11 --implementation cp llguidance -d "$wheels"
rm -rf .device/site
mkdir -p .device/site
for wheel in "$wheels"/*.whl; do
    "$python" -m zipfile -e "$wheel" .device/site
done
PYTHONPATH=.device/site "$python" -c "import llguidance; print('llguidance', llguidance.__version__, 'in .device/site')" \
    || echo "(not importable on this machine's Python; the device's Python imports it)"
du -sh .device
