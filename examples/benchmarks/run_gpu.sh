#!/usr/bin/env bash
# Runs laqat's GPU checks and benchmarks on a CUDA machine whose torch and triton are
# preinstalled and which has FLA as wheels in .whl/ (see ../shared/tools/device-wheels).
# Usage: examples/benchmarks/run_gpu.sh [stage ...]
#   warm      compile/autotune FLA's KDA kernels in the background (own process session, so it
#             outlives this command on a machine kept warm); later stages find them in Triton's cache.
#             It shares the GPU: do not time anything while it runs
#   exact     chunk kernels vs the fp64 chunk reference (fp32, K up to 128, varlen, HV > H, QDQ)
#   gdn kda   chunk_bench timing table for one kind, the three BASELINES shapes
#   train     a GDN+KDA model compiled with the FP8-state recipe trains through the chunk kernels
#   decode    decode-phase training (token / decay-grid / replay) vs FLA's chunk_kda
#   step      compiled FLA KDA model training step vs eager
#   recurrent generated recurrent kernel vs FLA (both kinds)   recurrent-kda: KDA rows only
#   fla qdq   FLA conv/norm custom ops on CUDA; QDQ device functions vs torch
#   prof      GDN kernel-by-kernel device times (FLA, laqat exact with both solves, FP8 state), two large shapes
#   stages    the launch table vs two pipeline stages in the serial h / dh loops vs LAQAT_AUTOTUNE=1 (kernel by kernel)
#   checks    first call of a session: FLA warm-up, compiled KDA step vs eager, FP8-state training, chunk
#             exactness (tf32x3 and IEEE fp32 dots) side by side; times nothing
#   pack      the compile caches (Triton's cubins incl. FLA's autotune choices, laqat's sources) to $OUT/caches.tgz.*:
#             carry them back as .gpu-cache/ and a later machine skips minutes of compiling
#   timed     second call: the IEEE exactness cases `checks` leaves, FLA equality, decode / recurrent / KDA tables
#   final     third call: the decode table with its kernel split, the KDA chunk table at the three shapes
#   decode-warps  the decode table at the launcher's default warps and at 4
#   kda-split KDA equality with FLA and the two large shapes, exact and FP8 state, kernels split
#   key-blocks the forward intra stage by key blocks: FLA equality, K = 128 exactness cases, KDA and GDN at the two
#             large shapes (key blocks of 64 / 32 / whole rows, FP8 state, FP8 state + W), kernels split
#   k256      KDA at head_k 256 (exactness, timing without FLA), the key-block settings at K = 128, GDN re-timed
#   k256-timed  k256 without its exactness part
#   defaults  the key-block defaults at the three KDA shapes and K = 256 (all policies), kernels split
#   diag      KDA's diagonal sub-chunk blocks as [NB, BC, BC, DS] tiles: KDA exactness cases, FLA equality, the two
#             large shapes (exact, FP8 state, autotuned: its choices copied to $OUT), kernels split
#   session5  the fifth session's table in one call: KDA at the two small shapes (every policy, the emulation),
#             at [8,4096,16,128] (exact, FP8 / INT8 state), GDN exact at [8,4096,16,128], FP8-state training
#   session6  KDA's rounded pair kernels: exactness (cases 8-10), the FP8 all-sites / NVFP4 rows at the two large
#             shapes (kernels split), GDN exact / FP8 state at [8,4096,16,128] with the key-blocked backward
#   session7  16-bit GEMMs: FLA equality + fp64-reference errors, fp32 exactness cases, KDA / GDN tables (TF32 rows)
#   kdapairs  KDA's diagonal pair blocks by dots: exactness cases 2,3,5,6, FLA equality, the KDA table (exact, FP8 / INT8 state)
#   table7    KDA, every policy at the three shapes; fp32 exactness cases 0,4,9,10
#   gdn7      GDN [8,4096,16,128] (exact, FP8 / INT8 state, TF32 GEMMs), then FP8-state training (20 steps)
#   blocks7   KDA [8,4096,16,128] exact: key blocks of 64 (forward intra / backward) and LAQAT_AUTOTUNE, kernels split
#   confirm7 pairs7  FLA equality, KDA exactness cases 2,3,6, KDA table (exact / FP8 / INT8 state), autotuned row
#   final7    the same without the autotuned row
#   train20   FP8-state training, 20 steps
#   session8  exactness cases (GDN, KDA, rounded pairs), FLA equality (both kinds), KDA every policy at the three
#             shapes (the emulation up to [1,4096,16,128]), GDN at [8,4096,16,128]
#   final8    the session's last kernels: KDA exactness cases 2,3, FLA equality (KDA), KDA exact / FP8 state
#             at the three shapes, GDN exact / FP8 state at [8,4096,16,128]
#   session9  KDA's decayed keys from the intra stage, the pairs kernel's range from the cumsum kernel: exactness cases
#             (GDN, KDA exact / INT8 state / K = 256 / rounded pairs), FLA equality (both kinds), KDA exact / FP8 state at the
#             three shapes, GDN exact / FP8 state at [8,4096,16,128], kernels split
#   final9    the ninth session's last kernels: KDA exactness cases 2,3, FLA equality (both kinds), KDA exact / FP8 state
#             at the three shapes, GDN exact / FP8 state at [8,4096,16,128], kernels split
#   gdn10     GDN at the two large shapes against FLA's fwd+bwd timed with its guard lifted (BASELINES' row): exact,
#             FP8 state, FP8 all sites, kernels split (FLA's too)
#   final10   GDN's backward with dA before its key loop: GDN exactness cases 0,1,4,8, FLA equality (GDN; laqat's
#             gradients against the fp64 reference), then the gdn10 table
#   last10    GDN exactness cases 4 (FP8 state + W, varlen) and 8 (K = 256, varlen), then both kinds at [1,4096,16,128]
#             (exact, FP8 state; host-bound: the launchers' host time)
#   kda10     KDA [8,4096,16,128]: the INT8-state and NVFP4 rows with the ninth session's kernels, kernels split
#   gdn9      GDN's h stage with the chunk decay on V_new's rows: GDN exactness cases 0,1,4, FLA equality (GDN),
#             GDN exact / FP8 state at [8,4096,16,128], kernels split
#   rounded9  KDA's FP8 all-sites row at [8,4096,16,128] with the ninth session's kernels (FLA in the same run)
#   div11     QDQ quotients by FMAs: the QDQ tests in both division forms, exactness cases 4 and 9, FP8 all sites of
#             both kinds at [8,4096,16,128] in both forms (kernels split), GDN exact / FP8 state
#   fp8h11    kd / A_qk rounded once in the intra stage: exactness cases 11, 12 (all FP8 sites), both kinds at
#             [8,4096,16,128] (exact, FP8 state, FP8 all sites; kernels split)
#   final11   the eleventh session's launch table: exactness cases 0, 4, 11, 12, both kinds at [8,4096,16,128] (exact,
#             FP8 state, FP8 all sites, NVFP4 operands; the rounded rows' kernels split)
#   next12    (next12gdn, next12kda: its halves) (unmeasured settings) the intra stage as one kernel against two (LAQAT_CHUNK_INTRA_SPLIT=1) and the forward
#             intra stage on grid values (LAQAT_CHUNK_FACTORED_SCALES=1): exactness case 11 under both, both kinds at
#             [8,4096,16,128] (exact, FP8 state, FP8 all sites under each setting; kernels split)
#   residual12  GDN's kept residual (exactness cases 0, 1, 11 on that path; rows with and without it), then next12kda
#   final12   KDA's kept residual (exactness cases 2, 3, 12; rows with and without it), then the GDN table
#   next13    LAQAT_CHUNK_KEEP_RESIDUAL=all against the default residual (exactness cases 1, 3; both kinds' rows)
#   setup     nothing but the set-up above (wheels, caches, laqat installed): for scratch scripts run after it
#   allsites  KDA's FP8 all-sites / NVFP4 rows at the two large shapes (kernels split, autotuned row; E4M3 arithmetic row)
#   rounded   KDA's FP8 all-sites / NVFP4 rows at the two large shapes, kernels split
#   final6    the final rounded pair kernels: exactness cases 9, 10, FP8 all sites / NVFP4 at [8,4096,16,128]
#   emul4096  KDA [1,4096,16,128]: exact, FP8 all sites, NVFP4 and the torch emulation in one run
#   table6    KDA, every policy at the three shapes, the rounded rows' kernels split
#   qdqchecks QDQ device functions on the GPU with and without its E4M3 conversion; the QDQ exactness cases
#   bundle    every log and JSON under $OUT into $OUT/results.tgz (the device returns at most 8 files)
# A session's calls: `checks pack bundle`, then with .gpu-cache/ (the caches.tgz.* that came back) carried:
# `timed pack bundle`, `final bundle`.
# Each stage prints its table and writes JSON under $OUT (default ./out).
set -uo pipefail
export OUT=${OUT:-out} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
# Fixed absolute paths: Triton's cache index records absolute file paths.
CACHE=/tmp/laqat-gpu-cache
export TRITON_CACHE_DIR=$CACHE/triton LAQAT_CACHE_DIR=$CACHE/laqat TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor
if ls .gpu-cache/caches.tgz.* >/dev/null 2>&1 && [ ! -d "$CACHE" ]; then
  cat .gpu-cache/caches.tgz.* | tar xzf - -C / && echo "restored compile caches: $(du -sh $CACHE | cut -f1)"
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
B=examples/benchmarks
POLICIES="laqat exact,laqat FP8 state,laqat INT8 state,laqat FP8 all sites,laqat NVFP4 operands"
# KDA [8,4096,16,128] under the key-block settings, then K = 256 (stages k256, k256-timed)
k256_timing() {
  OUT=$OUT/kda timeout 200 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
    --policies "laqat exact,laqat exact (intra key block 32),laqat exact (intra key block 16),laqat exact (bwd key block 32),laqat exact (key blocks 32 / bwd 32),laqat FP8 state" \
    --no-emulation-above 0 --profile "laqat exact,laqat exact (key blocks 32 / bwd 32)"
  OUT=$OUT/kda256 timeout 300 python3 $B/chunk_bench.py --skip-exactness --no-fla --kinds kda --shapes 1x4096x16x256 \
    --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact"
  echo "kda256 exit $?"
}
# FLA equality, KDA fp32 exactness cases ($1, in the background) and the KDA table (exact / FP8 / INT8 state, kernels split)
kda_final_checks() {
  OUT=$OUT/ieee timeout 300 python3 $B/chunk_bench.py --exactness-only --exact-cases "$1" >"$OUT/exact_ieee.log" 2>&1 &
  OUT=$OUT/equality timeout 150 python3 $B/chunk_bench.py --fla-equality kda:1x4096x16x128
  OUT=$OUT/kda timeout 240 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
    --policies "laqat exact,laqat FP8 state,laqat INT8 state" --no-emulation-above 0 --profile "laqat exact"
}
# The intra stage as one kernel against two (LAQAT_CHUNK_INTRA_SPLIT=1) and the forward stages' rounded products on
# grid values (the default since session 12; the "unfactored scales" row sets LAQAT_CHUNK_FACTORED_SCALES=0) at
# [8,4096,16,128], kernels split (stages next12, next12gdn, next12kda)
next12_gdn() {
  [ -n "${SKIP_EXACT:-}" ] || OUT=$OUT/ieee LAQAT_CHUNK_INTRA_SPLIT=1 timeout 150 python3 $B/chunk_bench.py \
    --exactness-only --exact-cases 11
  OUT=$OUT/gdn timeout 280 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
    --lift-fla-gdn-guard --no-emulation-above 0 --policies "laqat exact,laqat exact (split intra),\
laqat FP8 state,laqat FP8 state (split intra),laqat FP8 all sites,laqat FP8 all sites (split intra),\
laqat FP8 all sites (unfactored scales)" \
    --profile "laqat exact (split intra),laqat FP8 all sites,laqat FP8 all sites (split intra),\
laqat FP8 all sites (unfactored scales)"
}
next12_kda() {
  OUT=$OUT/kda timeout 300 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
    --no-emulation-above 0 --policies "laqat exact,laqat exact (split intra),laqat FP8 all sites,\
laqat FP8 all sites (split intra),laqat FP8 all sites (unfactored scales)" \
    --profile "laqat exact (split intra),laqat FP8 all sites (split intra),laqat FP8 all sites (unfactored scales)"
}
# GDN's training forward keeps T, A_qk and G for the backward (session 12): exactness cases 0, 1 and 11 on that path,
# then GDN's rows with and without it (LAQAT_CHUNK_KEEP_RESIDUAL=0), kernels split
residual12_gdn() {
  [ -n "${SKIP_EXACT:-}" ] || OUT=$OUT/ieee timeout 150 python3 $B/chunk_bench.py --exactness-only --exact-cases 0,1,11
  OUT=$OUT/gdn timeout 280 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
    --lift-fla-gdn-guard --no-emulation-above 0 --policies "laqat exact,laqat exact (no residual),\
laqat FP8 state,laqat FP8 state (no residual),laqat FP8 all sites,laqat FP8 all sites (no residual),\
laqat FP8 all sites (unfactored scales)" --profile "laqat exact,laqat FP8 state,laqat FP8 all sites"
}
# KDA's kept residual (T, A_qk, P): exactness cases 2, 3, 12 on that path and KDA's rows with and without it; then
# the GDN table (session 12's last call)
final12() {
  [ -n "${SKIP_EXACT:-}" ] || OUT=$OUT/ieee timeout 120 python3 $B/chunk_bench.py --exactness-only --exact-cases 2,3,12
  OUT=$OUT/kda timeout 250 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
    --no-emulation-above 0 --policies "laqat exact,laqat exact (no residual),laqat FP8 state,laqat FP8 all sites,\
laqat FP8 all sites (no residual),laqat NVFP4 operands" --profile "laqat exact,laqat FP8 all sites"
  OUT=$OUT/gdn timeout 180 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
    --lift-fla-gdn-guard --no-emulation-above 0 \
    --policies "laqat exact,laqat FP8 state,laqat FP8 all sites,laqat NVFP4 operands" --profile "laqat FP8 state"
}
# For the next session: LAQAT_CHUNK_KEEP_RESIDUAL=all (the backward runs no forward kernel) against the default
# residual, both kinds at [8,4096,16,128], with exactness cases 1 and 3 under it; then `gdn kda` (every shape and
# policy, the emulation where it fits) is the table the issue asks for
next13() {
  [ -n "${SKIP_EXACT:-}" ] || OUT=$OUT/ieee LAQAT_CHUNK_KEEP_RESIDUAL=all timeout 150 python3 $B/chunk_bench.py \
    --exactness-only --exact-cases 1,3
  OUT=$OUT/gdn13 timeout 200 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
    --lift-fla-gdn-guard --no-emulation-above 0 --policies "laqat exact,laqat exact (keep all),laqat FP8 state,\
laqat FP8 state (keep all),laqat FP8 all sites,laqat FP8 all sites (keep all)" --profile "laqat exact (keep all)"
  OUT=$OUT/kda13 timeout 200 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
    --no-emulation-above 0 --policies "laqat exact,laqat exact (keep all),laqat FP8 all sites,\
laqat FP8 all sites (keep all)" --profile "laqat exact (keep all)"
}
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
    stages)    timeout 300 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 1x4096x16x128,8x4096x16x128 \
                 --policies "laqat exact,laqat exact (2-stage serial loops),laqat exact (autotuned)" \
                 --no-emulation-above 0 --profile "laqat exact,laqat exact (2-stage serial loops),laqat exact (autotuned)" ;;
    checks)    setsid nohup python3 $B/warm_fla.py --group bf16-128 >"$OUT/warm_bf16_128.log" 2>&1 < /dev/null &
               setsid nohup python3 $B/warm_fla.py --group bf16-64 >"$OUT/warm_bf16_64.log" 2>&1 < /dev/null &
               timeout 440 python3 $B/compiled_step_vs_eager.py --first-autotune-config >"$OUT/step.log" 2>&1 &
               step_pid=$!
               timeout 300 python3 $B/train_fp8_state_gpu.py --steps 20 >"$OUT/train.log" 2>&1 &
               train_pid=$!
               LAQAT_FP32_DOT=tf32x3 OUT=$OUT/tf32x3 timeout 180 python3 $B/chunk_bench.py --exactness-only
               timeout 240 python3 $B/chunk_bench.py --exactness-only
               wait $step_pid $train_pid
               tail -n 5 "$OUT"/step.log "$OUT"/train.log "$OUT"/warm_*.log ;;
    pack)      # cubins, metadata and launchers only (the IR text is 80% of Triton's cache); no Inductor cache
               pkill -f warm_fla.py; tar czf - -C / --exclude='*.llir' --exclude='*.ptx' --exclude='*.ttir' \
                 --exclude='*.ttgir' --exclude='*.source' --exclude=inductor "${CACHE#/}" | split -b 15m - "$OUT/caches.tgz."
               ls -l "$OUT"/caches.tgz.* ;;
    bundle)    (cd "$OUT" && tar czf /tmp/results.tgz --exclude='caches.tgz.*' . && mv /tmp/results.tgz . \
                 && find . -type f ! -name 'caches.tgz.*' ! -name results.tgz ! -name run.log -delete) ;;
    timed)     # second call of a session (after `checks`, caches carried): the IEEE exactness cases left over
               # compile in the background (CPU-bound); FLA equality, then the decode / recurrent / KDA chunk tables
               OUT=$OUT/ieee timeout 420 python3 $B/chunk_bench.py --exactness-only --exact-cases 3,4,5 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               timeout 200 python3 $B/decode_bench.py --quick --num-warps 4 --policies token decay-grid replay --profile
               OUT=$OUT/equality timeout 150 python3 $B/chunk_bench.py --fla-equality kda:1x4096x16x128,gdn:8x4096x16x128
               timeout 100 python3 $B/recurrent_vs_fla.py --kinds kda --skip-exactness
               wait
               cat "$OUT/exact_ieee.log"
               timeout 150 python3 $B/chunk_bench.py --skip-exactness --kinds kda --policies "laqat exact,laqat FP8 state" \
                 --shapes 8x4096x16x128 --no-emulation-above 0 --profile "FLA exact,laqat exact" ;;
    final)     # third call: the decode table with its kernel split, the KDA chunk table (FLA's backward runs for KDA)
               timeout 150 python3 $B/decode_bench.py --quick --num-warps 4 --policies token decay-grid replay --profile
               timeout 240 python3 $B/chunk_bench.py --skip-exactness --kinds kda --policies "$POLICIES" \
                 --no-emulation-above 65536 --profile "FLA exact,laqat exact" ;;
    decode-warps) # the decode table at the launcher's default warps (8 at K = 128, BV = 64) and at 4, kernels split
               timeout 330 python3 $B/decode_bench.py --quick --num-warps 8 4 --policies token decay-grid replay --profile ;;
    kda-split) # KDA with the pair gradients by key block: equality with FLA, then the two large shapes
               OUT=$OUT/equality timeout 90 python3 $B/chunk_bench.py --fla-equality kda:1x4096x16x128
               timeout 170 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 1x4096x16x128,8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact" ;;
    key-blocks) OUT=$OUT/ieee timeout 400 python3 $B/chunk_bench.py --exactness-only --exact-cases 1,2,4 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/equality timeout 90 python3 $B/chunk_bench.py --fla-equality kda:1x4096x16x128
               OUT=$OUT/kda timeout 200 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 1x4096x16x128,8x4096x16x128 \
                 --policies "laqat exact,laqat exact (intra whole key rows),laqat exact (intra key block 32),laqat FP8 state,laqat FP8 state + W" \
                 --no-emulation-above 0 --profile "laqat exact,laqat exact (intra whole key rows)"
               OUT=$OUT/gdn timeout 150 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 1x4096x16x128,8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact"
               wait; cat "$OUT/exact_ieee.log" ;;
    k256)      OUT=$OUT/ieee timeout 420 python3 $B/chunk_bench.py --exactness-only --exact-cases 6,7 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               k256_timing
               wait; cat "$OUT/exact_ieee.log" ;;
    k256-timed) k256_timing ;;  # the call after k256: its timing part only
    defaults)  OUT=$OUT/kda timeout 330 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
                 --shapes 1x1024x4x64,1x4096x16x128,8x4096x16x128 --policies "$POLICIES,laqat FP8 state + W" \
                 --no-emulation-above 65536 --profile "laqat exact"
               OUT=$OUT/kda256 timeout 200 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 1x4096x16x256 \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact" ;;
    diag)      OUT=$OUT/ieee timeout 400 python3 $B/chunk_bench.py --exactness-only --exact-cases 2,3,5,6,7 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/equality timeout 120 python3 $B/chunk_bench.py --fla-equality kda:1x4096x16x128
               OUT=$OUT/kda timeout 300 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 1x4096x16x128,8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state,laqat exact (autotuned)" --no-emulation-above 0 \
                 --profile "FLA exact,laqat exact,laqat exact (autotuned)"
               cp "$LAQAT_CACHE_DIR/autotune/chunk.json" "$OUT/autotune_chunk.json"
               wait; cat "$OUT/exact_ieee.log" ;;
    session5)  OUT=$OUT/kda timeout 170 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
                 --shapes 1x1024x4x64,1x4096x16x128 --policies "$POLICIES,laqat FP8 state + W" \
                 --no-emulation-above 65536 --profile "laqat exact"
               OUT=$OUT/kda8 timeout 100 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state,laqat INT8 state" --no-emulation-above 0 --profile "laqat exact"
               OUT=$OUT/gdn timeout 50 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --policies "laqat exact" --no-emulation-above 0 --profile "laqat exact"
               timeout 75 python3 $B/train_fp8_state_gpu.py --steps 20 ;;
    session6)  # KDA's rounded pair products by sub-chunk (all-sites / NVFP4 rows) and GDN's key-blocked backward
               OUT=$OUT/ieee timeout 400 python3 $B/chunk_bench.py --exactness-only --exact-cases 8,9,10 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/kda timeout 330 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
                 --shapes 1x4096x16x128,8x4096x16x128 --policies "laqat exact,laqat FP8 all sites,laqat NVFP4 operands" \
                 --no-emulation-above 65536 --profile "laqat FP8 all sites"
               OUT=$OUT/gdn timeout 120 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact"
               wait; cat "$OUT/exact_ieee.log" ;;
    session8)  OUT=$OUT/ieee timeout 400 python3 $B/chunk_bench.py --exactness-only --exact-cases 0,1,2,3,4,9,10 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/equality timeout 150 python3 $B/chunk_bench.py --fla-equality kda:1x4096x16x128,gdn:1x4096x16x128
               OUT=$OUT/kda timeout 330 python3 $B/chunk_bench.py --skip-exactness --kinds kda --policies "$POLICIES" \
                 --no-emulation-above 65536 --profile "laqat exact"
               OUT=$OUT/gdn timeout 90 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact"
               wait; cat "$OUT/exact_ieee.log" ;;
    session9)  OUT=$OUT/ieee timeout 300 python3 $B/chunk_bench.py --exactness-only --exact-cases 0,2,3,5,6,9 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/equality timeout 150 python3 $B/chunk_bench.py --fla-equality kda:1x4096x16x128,gdn:1x4096x16x128
               OUT=$OUT/kda timeout 150 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact"
               OUT=$OUT/gdn timeout 60 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact"
               wait; cat "$OUT/exact_ieee.log" ;;
    final9)    OUT=$OUT/ieee timeout 150 python3 $B/chunk_bench.py --exactness-only --exact-cases 2,3 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/equality timeout 120 python3 $B/chunk_bench.py --fla-equality kda:1x4096x16x128,gdn:1x4096x16x128
               wait; cat "$OUT/exact_ieee.log"
               OUT=$OUT/kda timeout 150 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact"
               OUT=$OUT/gdn timeout 60 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact" ;;
    gdn9)      OUT=$OUT/ieee timeout 150 python3 $B/chunk_bench.py --exactness-only --exact-cases 0,1,4 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/equality timeout 90 python3 $B/chunk_bench.py --fla-equality gdn:1x4096x16x128
               wait; cat "$OUT/exact_ieee.log"
               OUT=$OUT/gdn timeout 60 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact" ;;
    rounded9)  OUT=$OUT/kda timeout 220 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
                 --policies "laqat FP8 all sites" --no-emulation-above 0 --profile "laqat FP8 all sites" ;;
    gdn10)     OUT=$OUT/gdn timeout 300 python3 $B/chunk_bench.py --skip-exactness --kinds gdn \
                 --shapes 1x4096x16x128,8x4096x16x128 --lift-fla-gdn-guard --no-emulation-above 0 \
                 --policies "laqat exact,laqat FP8 state,laqat FP8 all sites" \
                 --profile "FLA exact,laqat exact,laqat FP8 state,laqat FP8 all sites" ;;
    final10)   OUT=$OUT/ieee timeout 170 python3 $B/chunk_bench.py --exactness-only --exact-cases 0,1,4,8
               OUT=$OUT/equality timeout 100 python3 $B/chunk_bench.py --fla-equality gdn:1x4096x16x128
               bash "$0" gdn10 ;;
    last10)    OUT=$OUT/ieee timeout 220 python3 $B/chunk_bench.py --exactness-only --exact-cases 4,8
               OUT=$OUT/small timeout 120 python3 $B/chunk_bench.py --skip-exactness --shapes 1x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --lift-fla-gdn-guard ;;
    kda10)     OUT=$OUT/kda timeout 280 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
                 --policies "laqat INT8 state,laqat NVFP4 operands" --no-emulation-above 0 \
                 --profile "laqat INT8 state,laqat NVFP4 operands" ;;
    div11)     # the QDQ quotient by FMAs: QDQ device functions in both division forms (and without the E4M3
               # conversion), exactness cases with rounding (background), then FP8 all sites of both kinds at
               # [8,4096,16,128] (kernels split) and again with LAQAT_QDQ_DIVISION=rn; GDN exact / FP8 state
               OUT=$OUT/ieee timeout 300 python3 $B/chunk_bench.py --exactness-only --exact-cases 4,9 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qdq_triton.py
               LAQAT_QDQ_DIVISION=rn timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qdq_triton.py
               LAQAT_QDQ_FP8_CAST=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qdq_triton.py
               wait; cat "$OUT/exact_ieee.log"
               OUT=$OUT/gdn timeout 200 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --lift-fla-gdn-guard --no-emulation-above 0 \
                 --policies "laqat exact,laqat FP8 state,laqat FP8 all sites" \
                 --profile "laqat exact,laqat FP8 all sites"
               OUT=$OUT/kda timeout 200 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
                 --no-emulation-above 0 --policies "laqat FP8 all sites" --profile "laqat FP8 all sites"
               OUT=$OUT/rn LAQAT_QDQ_DIVISION=rn timeout 200 python3 $B/chunk_bench.py --skip-exactness --kinds gdn,kda \
                 --shapes 8x4096x16x128 --no-fla --no-emulation-above 0 --policies "laqat FP8 all sites" ;;
    fp8h11)    # kd and A_qk rounded once in the intra stage: exactness cases 11, 12 (all FP8 sites), then
               # both kinds at [8,4096,16,128]: exact, FP8 state, FP8 all sites (kernels split)
               OUT=$OUT/ieee timeout 250 python3 $B/chunk_bench.py --exactness-only --exact-cases 11,12
               OUT=$OUT/gdn timeout 200 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --lift-fla-gdn-guard --no-emulation-above 0 \
                 --policies "laqat exact,laqat FP8 state,laqat FP8 all sites" --profile "laqat FP8 all sites"
               OUT=$OUT/kda timeout 250 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
                 --no-emulation-above 0 --policies "laqat exact,laqat FP8 state,laqat FP8 all sites" \
                 --profile "laqat FP8 all sites" ;;
    final11)   # the eleventh session's launch table (four warps in h / o / dh with rounded operands, GDN's whole-row
               # backward by value blocks of 32): exactness cases 0, 4, 11, 12, then both kinds at [8,4096,16,128]
               # (exact, FP8 state, FP8 all sites, NVFP4 operands; the rounded rows' kernels split)
               OUT=$OUT/ieee timeout 250 python3 $B/chunk_bench.py --exactness-only --exact-cases 0,4,11,12
               OUT=$OUT/gdn timeout 220 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --lift-fla-gdn-guard --no-emulation-above 0 \
                 --policies "laqat exact,laqat FP8 state,laqat FP8 all sites,laqat NVFP4 operands" \
                 --profile "laqat FP8 all sites,laqat NVFP4 operands"
               OUT=$OUT/kda timeout 280 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
                 --no-emulation-above 0 --policies "laqat exact,laqat FP8 state,laqat FP8 all sites,laqat NVFP4 operands" \
                 --profile "laqat FP8 all sites,laqat NVFP4 operands" ;;
    next12)    next12_gdn; next12_kda ;;  # exactness case 11 (GDN, all FP8 sites) under both settings, then both kinds
    next12gdn) next12_gdn ;;
    next12kda) next12_kda ;;
    residual12) residual12_gdn; next12_kda ;;
    final12)   final12 ;;
    next13)    next13 ;;
    exact12)   # the all-FP8-sites exactness cases (GDN 11, KDA 12) on the default path (kept residual, factored
               # scales), in parallel: each takes minutes of fp64 reference
               OUT=$OUT/ieee11 timeout 420 python3 $B/chunk_bench.py --exactness-only --exact-cases 11 >"$OUT/e11.log" 2>&1 &
               OUT=$OUT/ieee12 timeout 420 python3 $B/chunk_bench.py --exactness-only --exact-cases 12 >"$OUT/e12.log" 2>&1 &
               wait; cat "$OUT/e11.log" "$OUT/e12.log" ;;  # the kept residual (GDN), then the KDA half of next12
    setup)     ;;
    final8)    OUT=$OUT/ieee timeout 200 python3 $B/chunk_bench.py --exactness-only --exact-cases 2,3 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/equality timeout 90 python3 $B/chunk_bench.py --fla-equality kda:1x4096x16x128
               OUT=$OUT/kda timeout 150 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact"
               OUT=$OUT/gdn timeout 60 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state" --no-emulation-above 0 --profile "laqat exact"
               wait; cat "$OUT/exact_ieee.log" ;;
    session7)  # 16-bit GEMMs for bf16 inputs: FLA equality (both against the fp64 reference too), fp32 exactness
               # cases (unchanged numerics), KDA and GDN tables with the TF32-GEMM rows, kernels split
               OUT=$OUT/ieee timeout 300 python3 $B/chunk_bench.py --exactness-only --exact-cases 1,2,4 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/equality timeout 200 python3 $B/chunk_bench.py --fla-equality kda:1x4096x16x128,gdn:1x4096x16x128
               OUT=$OUT/kda timeout 300 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
                 --shapes 1x4096x16x128,8x4096x16x128 \
                 --policies "laqat exact,laqat exact (TF32 GEMMs),laqat FP8 state,laqat FP8 state (TF32 GEMMs),laqat INT8 state" \
                 --no-emulation-above 0 --profile "FLA exact,laqat exact,laqat FP8 state"
               OUT=$OUT/gdn timeout 120 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --policies "laqat exact,laqat exact (TF32 GEMMs),laqat FP8 state" --no-emulation-above 0 --profile "laqat exact"
               wait; cat "$OUT/exact_ieee.log" ;;
    kdapairs)  # KDA's exact pair kernels with the diagonal blocks by dots: exactness, FLA equality, the KDA table
               OUT=$OUT/ieee timeout 300 python3 $B/chunk_bench.py --exactness-only --exact-cases 2,3,5,6 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/equality timeout 200 python3 $B/chunk_bench.py --fla-equality kda:1x4096x16x128
               OUT=$OUT/kda timeout 300 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
                 --shapes 1x1024x4x64,1x4096x16x128,8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state,laqat INT8 state" \
                 --no-emulation-above 0 --profile "laqat exact"
               wait; cat "$OUT/exact_ieee.log" ;;
    table7)    # the seventh session's KDA table: every policy at the three shapes; fp32 exactness of the rounded paths
               OUT=$OUT/ieee timeout 400 python3 $B/chunk_bench.py --exactness-only --exact-cases 0,4,9,10 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/kda timeout 440 python3 $B/chunk_bench.py --skip-exactness --kinds kda --policies "$POLICIES" \
                 --no-emulation-above 65536 --profile "laqat exact"
               wait; cat "$OUT/exact_ieee.log" ;;
    gdn7)      # GDN at [8,4096,16,128] (exact, FP8 / INT8 state, TF32 rows), then FP8-state training, 20 steps
               OUT=$OUT/gdn timeout 150 python3 $B/chunk_bench.py --skip-exactness --kinds gdn --shapes 8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state,laqat INT8 state,laqat exact (TF32 GEMMs)" --no-emulation-above 0 \
                 --profile "laqat exact"
               timeout 300 python3 $B/train_fp8_state_gpu.py --steps 20 ;;
    blocks7)   # KDA [8,4096,16,128] exact under the key-block settings and LAQAT_AUTOTUNE (16-bit GEMMs), kernels split
               OUT=$OUT/kda timeout 330 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
                 --policies "laqat exact,laqat exact (intra key block 64),laqat exact (bwd key block 64),laqat exact (autotuned)" \
                 --no-emulation-above 0 --profile "laqat exact,laqat exact (intra key block 64),laqat exact (bwd key block 64),laqat exact (autotuned)"
               cp "$LAQAT_CACHE_DIR/autotune/chunk.json" "$OUT/autotune_chunk.json" ;;
    confirm7|pairs7|final7)  # the KDA checks of the session's last calls (pairs7 ran a backward form since reverted;
               # on main the three run the final kernels): FLA equality, KDA fp32 exactness, the KDA table, autotuned row
               kda_final_checks 2,3,6
               [ "$stage" = final7 ] || { OUT=$OUT/kda_tuned timeout 150 python3 $B/chunk_bench.py --skip-exactness \
                 --kinds kda --shapes 8x4096x16x128 --policies "laqat exact,laqat exact (autotuned)" --no-emulation-above 0 \
                 --profile "laqat exact (autotuned)"; cp "$LAQAT_CACHE_DIR/autotune/chunk.json" "$OUT/autotune_chunk.json"; }
               wait; cat "$OUT/exact_ieee.log" ;;
    train20)   timeout 400 python3 $B/train_fp8_state_gpu.py --steps 20 ;;
    allsites)  # the all-sites / NVFP4 rows after the shared pair QDQ, the GPU's E4M3 conversion and eight warps
               OUT=$OUT/kda timeout 300 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
                 --shapes 1x4096x16x128,8x4096x16x128 \
                 --policies "laqat exact,laqat FP8 state,laqat FP8 all sites,laqat NVFP4 operands,laqat FP8 all sites (autotuned)" \
                 --no-emulation-above 65536 --profile "laqat FP8 all sites,laqat NVFP4 operands"
               cp "$LAQAT_CACHE_DIR/autotune/chunk.json" "$OUT/autotune_chunk.json"
               LAQAT_QDQ_FP8_CAST=0 OUT=$OUT/kda_arith timeout 150 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
                 --shapes 8x4096x16x128 --policies "laqat FP8 all sites" --no-emulation-above 0 --no-fla ;;
    rounded)   # the FP8 all-sites / NVFP4 rows at the two large shapes, kernels split (after a rounded-pair change)
               OUT=$OUT/kda timeout 300 python3 $B/chunk_bench.py --skip-exactness --kinds kda \
                 --shapes 1x4096x16x128,8x4096x16x128 --policies "laqat exact,laqat FP8 all sites,laqat NVFP4 operands" \
                 --no-emulation-above 0 --profile "laqat FP8 all sites,laqat NVFP4 operands" ;;
    final6)    # the final rounded pair kernels: exactness cases 9, 10 and the two rounded rows at [8,4096,16,128]
               OUT=$OUT/ieee timeout 300 python3 $B/chunk_bench.py --exactness-only --exact-cases 9,10 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               OUT=$OUT/kda timeout 200 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 8x4096x16x128 \
                 --policies "laqat FP8 all sites,laqat NVFP4 operands" --no-emulation-above 0 \
                 --profile "laqat FP8 all sites,laqat NVFP4 operands"
               wait; cat "$OUT/exact_ieee.log" ;;
    emul4096)  # the rounded rows against the torch emulation in one run, KDA [1,4096,16,128]
               OUT=$OUT/kda timeout 200 python3 $B/chunk_bench.py --skip-exactness --kinds kda --shapes 1x4096x16x128 \
                 --policies "laqat exact,laqat FP8 all sites,laqat NVFP4 operands" --no-emulation-above 65536 ;;
    table6)    # the sixth session's KDA table: every policy at the three shapes (kernels of the rounded rows split)
               OUT=$OUT/kda timeout 420 python3 $B/chunk_bench.py --skip-exactness --kinds kda --policies "$POLICIES" \
                 --no-emulation-above 65536 --profile "laqat FP8 all sites,laqat NVFP4 operands" ;;
    qdqchecks) # the QDQ device functions bit for bit with the GPU's E4M3 conversion and without; QDQ exactness cases
               OUT=$OUT/ieee timeout 400 python3 $B/chunk_bench.py --exactness-only --exact-cases 4,5,9,10 \
                 >"$OUT/exact_ieee.log" 2>&1 &
               timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qdq_triton.py
               LAQAT_QDQ_FP8_CAST=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qdq_triton.py
               wait; cat "$OUT/exact_ieee.log" ;;
    fla)       timeout 300 python3 $B/fla_frontend_gpu_check.py ;;
    qdq)       timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qdq_triton.py ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "=== $stage exit $? $(date +%T) ==="
done
[ -f /tmp/warm_fla.log ] && { echo "--- warm_fla.log"; cat /tmp/warm_fla.log; cp /tmp/warm_fla.log "$OUT/"; }
exit 0
