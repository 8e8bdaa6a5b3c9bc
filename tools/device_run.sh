#!/usr/bin/env bash
# One part of the device check on the lent GPU machine, from the repository root (docs/development.md,
# "The device check"): its wheels installed into a folder of their own, then tools.gpu_check.
#
#   bash tools/device_run.sh core        # carry: .device/core .device/smollm2
#   bash tools/device_run.sh pipeline    # carry: .device/pipeline
#   PYTHON=.device/rehearsal/bin/python bash tools/device_run.sh core --device cpu --tiny   # the CPU rehearsal
#
# Writes into $OUT (the device tool's folder that comes back; ./device_out here): <part>.json,
# <part>.md, <part>.log and <part>-device.txt (nvidia-smi's name, memory and driver).
set -euo pipefail
part=${1:?usage: device_run.sh core|pipeline [gpu_check options]}
shift
case "$part" in core|pipeline) ;; *) echo "device_run.sh: part must be core or pipeline, not '$part'" >&2; exit 2 ;; esac
python=${PYTHON:-python3}
out=${OUT:-device_out}
site=${TMPDIR:-/tmp}/qllm-site-$part
wheels=(.device/"$part"/*.whl)
[ -e "${wheels[0]}" ] || { echo "device_run.sh: no wheels in .device/$part (make device-wheels, then carry .device/$part)" >&2; exit 2; }
mkdir -p "$out"
rm -rf "$site"
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check --target "$site" "${wheels[@]}"
export PYTHONPATH="$site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/$part-device.txt" 2>&1 || true
else
    echo "no nvidia-smi; $("$python" -c 'import platform; print(platform.processor() or platform.machine())')" > "$out/$part-device.txt"
fi
"$python" -m tools.gpu_check "$part" --out "$out" "$@" 2>&1 | tee "$out/$part.log"
