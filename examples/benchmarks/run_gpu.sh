#!/usr/bin/env bash
# Runs laqat's GPU checks and benchmarks on a CUDA machine whose torch and triton are
# preinstalled and which has FLA as wheels in .whl/ (see ../shared/tools/device-wheels).
# Usage: examples/benchmarks/run_gpu.sh [stage ...]
#   warm      compile/autotune FLA's KDA kernels in the background (own process session, so it
#             outlives this command on a machine kept warm); later stages find them in Triton's cache.
#             It shares the GPU: do not time anything while it runs (`next` waits for it)
#   exact     chunk kernels vs the fp64 chunk reference (fp32, K up to 128, varlen, HV > H, QDQ)
#   gdn kda   chunk_bench timing table for one kind, the three BASELINES shapes
#   train     a GDN+KDA model compiled with the FP8-state recipe trains through the chunk kernels
#   decode    decode-phase training (token / decay-grid / replay) vs FLA's chunk_kda
#   step      compiled FLA KDA model training step vs eager
#   recurrent generated recurrent kernel vs FLA (both kinds)   recurrent-kda: KDA rows only
#   fla qdq   FLA conv/norm custom ops on CUDA; QDQ device functions vs torch
#   prof      GDN kernel-by-kernel device times (FLA, laqat exact with both solves, FP8 state), two large shapes
#   next      every check the open issues still need on the GPU, after `warm` (see the stage below)
#   stages    the launch table vs two pipeline stages in the serial h / dh loops vs LAQAT_AUTOTUNE=1 (kernel by kernel)
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
B=examples/benchmarks
POLICIES="laqat exact,laqat FP8 state,laqat INT8 state,laqat FP8 all sites,laqat NVFP4 operands"
stages=${*:-exact gdn train decode}
for stage in $stages; do
  echo "=== $stage $(date +%T) ==="
  case $stage in
    warm)      setsid nohup python3 $B/warm_fla.py >/tmp/warm_fla.log 2>&1 < /dev/null & ;;
    exact)     timeout 240 python3 $B/chunk_bench.py --exactness-only ;;
    gdn|kda)   timeout 420 python3 $B/chunk_bench.py --skip-exactness --kinds $stage --policies "$POLICIES" \
                 --no-emulation-above 65536 ;;
    train)     timeout 240 python3 $B/train_fp8_state_gpu.py ;;
    decode)    timeout 300 python3 $B/decode_bench.py --num-warps 4 8 ;;
    step)      timeout 420 python3 $B/compiled_step_vs_eager.py ;;
    recurrent) timeout 300 python3 $B/recurrent_vs_fla.py ;;
    recurrent-kda) timeout 300 python3 $B/recurrent_vs_fla.py --kinds kda --skip-exactness ;;
    prof)      timeout 420 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 1x4096x16x128,8x4096x16x128 \
                 --policies "laqat exact,laqat exact (row-by-row solve),laqat FP8 state" --no-emulation-above 0 \
                 --profile "FLA exact,laqat exact,laqat exact (row-by-row solve),laqat FP8 state" ;;
    next)      # what the issues still need on the GPU (2026-11-29 note), in one call after `warm`: checks
               # that time nothing run beside the background warm-up; timings wait until it has finished
               # (it shares the GPU: the second session's run 1 and 2 timings ran beside it)
               timeout 240 python3 $B/compiled_step_vs_eager.py
               timeout 150 python3 $B/train_fp8_state_gpu.py --steps 20
               timeout 240 python3 $B/chunk_bench.py --exactness-only
               LAQAT_FP32_DOT=tf32x3 OUT=$OUT/tf32x3 timeout 150 python3 $B/chunk_bench.py --exactness-only
               timeout 300 bash -c 'while pgrep -f warm_fla.py >/dev/null; do sleep 5; done'
               timeout 120 python3 $B/recurrent_vs_fla.py --kinds kda --skip-exactness
               timeout 200 python3 $B/decode_bench.py --num-warps 4 --policies token decay-grid replay
               timeout 300 python3 $B/chunk_bench.py --skip-exactness --kinds kda --policies "$POLICIES" \
                 --no-emulation-above 65536 --profile "FLA exact,laqat exact" ;;
    stages)    timeout 300 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 1x4096x16x128,8x4096x16x128 \
                 --policies "laqat exact,laqat exact (2-stage serial loops),laqat exact (autotuned)" \
                 --no-emulation-above 0 --profile "laqat exact,laqat exact (2-stage serial loops),laqat exact (autotuned)" ;;
    fla)       timeout 300 python3 $B/fla_frontend_gpu_check.py ;;
    qdq)       timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qdq_triton.py ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "=== $stage exit $? $(date +%T) ==="
done
[ -f /tmp/warm_fla.log ] && { echo "--- warm_fla.log"; cat /tmp/warm_fla.log; cp /tmp/warm_fla.log "$OUT/"; }
exit 0
