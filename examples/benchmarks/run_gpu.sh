#!/usr/bin/env bash
# Runs laqat's GPU checks and benchmarks on a CUDA machine whose torch and triton are
# preinstalled and which has FLA as wheels in .whl/ (see ../shared/tools/device-wheels).
# Usage: examples/benchmarks/run_gpu.sh [stage ...]   stages: recurrent step decode chunk qdq fla
# Each stage prints its table and writes JSON under $OUT (default ./out).
set -uo pipefail
export OUT=${OUT:-out} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
stages=${*:-recurrent step decode chunk}
for stage in $stages; do
  echo "=== $stage ==="
  case $stage in
    recurrent) timeout 300 python3 examples/benchmarks/recurrent_vs_fla.py ;;
    step)      timeout 300 python3 examples/benchmarks/compiled_step_vs_eager.py ;;
    decode)    timeout 300 python3 examples/benchmarks/decode_bench.py ;;
    chunk)     timeout 420 python3 examples/benchmarks/chunk_bench.py ;;
    fla)       timeout 300 python3 examples/benchmarks/fla_frontend_gpu_check.py ;;
    qdq)       timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qdq_triton.py ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "=== $stage exit $? ==="
done
