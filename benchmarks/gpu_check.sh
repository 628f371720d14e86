#!/usr/bin/env bash
# One run on a machine with one NVIDIA GPU and no network (e.g. the device tool's H200),
# in under 8 minutes: install the wheels carried in .whl/ (`make gpu-wheels` fetches them
# here), run the `gpu` tests, batch-1 decode latency, host time per decode step with and
# without overlap scheduling, the prefix cache off and on, and the offline benchmark at full
# size for our engine and for transformers' continuous batching; write a results table.
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

timeout 180 python3 -m pytest -q -m gpu tests/unit -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
timeout 90 python3 benchmarks/decode_latency.py --config qwen3-0.6b --dummy-weights \
  --json "$OUT/decode_latency.json" 2>&1 | tee "$OUT/decode_latency.log"
for mode in --overlap --disable-overlap-schedule; do
  timeout 60 python3 benchmarks/step_overhead.py --device cuda "$mode" --steps 16 \
    --json "$OUT/step_overhead${mode//-/_}.json" 2>&1 | tee -a "$OUT/step_overhead.log"
done
timeout 90 python3 benchmarks/prefix_cache.py --config qwen3-0.6b --repeat 1 \
  --json "$OUT/prefix_cache.json" 2>&1 | tee "$OUT/prefix_cache.log"
left=$((470 - ($(date +%s) - start)))
timeout "$left" python3 benchmarks/offline.py --config qwen3-0.6b --dummy-weights \
  --baseline transformers-cb --json "$OUT/offline.json" 2>&1 | tee "$OUT/offline.log"
python3 benchmarks/results_table.py "$OUT" | tee "$OUT/RESULTS.md"
