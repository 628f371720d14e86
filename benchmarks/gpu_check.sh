#!/usr/bin/env bash
# One run on a machine with one NVIDIA GPU and no network (e.g. the device tool's H200),
# in under 10 minutes: install the wheels carried in .whl/ (`make gpu-wheels` fetches them
# here), run `python -m minisgl doctor --json` first (does the fast path compute what it
# should on this GPU: Triton kernels, CUDA graphs, overlap; its exit status is reported, and
# the steps after it run whatever it found), then the `gpu` tests, batch-1 decode latency,
# host time per decode step with and without overlap scheduling, the prefix cache off and
# on, and the offline benchmark at full size for our engine and for transformers'
# continuous batching; write a results table.
#
#   bash benchmarks/gpu_check.sh            # results in $OUT (or ./gpu-results)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/minisgl-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/minisgl-site:$PWD
else
  export PYTHONPATH=$PWD
fi
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$OUT/gpu.txt"

# the doctor's own probe is short here: the benchmarks below measure throughput properly
timeout 200 python3 -m minisgl doctor --json --probe-seconds 4 >"$OUT/doctor.json" 2>"$OUT/doctor.log"
echo "doctor: exit status $? (0: every check passed; the failures are in doctor.json)" | tee -a "$OUT/doctor.log"
python3 benchmarks/results_table.py --doctor "$OUT" | tee "$OUT/doctor.txt"
doctor_s=$(($(date +%s) - start))

timeout 180 python3 -m pytest -q -m gpu tests/unit -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
timeout 90 python3 benchmarks/decode_latency.py --config qwen3-0.6b --dummy-weights \
  --json "$OUT/decode_latency.json" 2>&1 | tee "$OUT/decode_latency.log"
for mode in --overlap --disable-overlap-schedule; do
  timeout 60 python3 benchmarks/step_overhead.py --device cuda "$mode" --steps 16 \
    --json "$OUT/step_overhead${mode//-/_}.json" 2>&1 | tee -a "$OUT/step_overhead.log"
done
timeout 90 python3 benchmarks/prefix_cache.py --config qwen3-0.6b --repeat 1 \
  --json "$OUT/prefix_cache.json" 2>&1 | tee "$OUT/prefix_cache.log"
# the offline benchmark gets what is left of 470 s after the doctor, within the 10 minutes
elapsed=$(($(date +%s) - start))
left=$((470 + doctor_s - elapsed))
cap=$((570 - elapsed))
left=$((left < cap ? left : cap))
timeout "$left" python3 benchmarks/offline.py --config qwen3-0.6b --dummy-weights \
  --baseline transformers-cb --json "$OUT/offline.json" 2>&1 | tee "$OUT/offline.log"
python3 benchmarks/results_table.py "$OUT" | tee "$OUT/RESULTS.md"
