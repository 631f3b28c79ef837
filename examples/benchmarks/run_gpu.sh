#!/usr/bin/env bash
# laqat's GPU checks and benchmarks, as named suites, from the repository root of a CUDA machine.
#
#   examples/benchmarks/run_gpu.sh SUITE[:PART] ...    run suites (or single parts of them), in order
#   examples/benchmarks/run_gpu.sh --list              the suites and their parts
#   examples/benchmarks/run_gpu.sh --dry-run SUITE ... print the commands each part would run, run nothing
#
# Suites (each part prints its table and writes its JSON under $OUT/<suite>/<part>/, default OUT=out):
#   exactness  the chunk kernels' forward and every gradient against fp64 autograd of the chunk reference (fp32, every
#              case of chunk_bench.py's EXACT_CASES, in three parts), laqat's chunk kernels against FLA's (bf16), the
#              QDQ device functions bit for bit against torch (both division forms, both E4M3 roundings), the
#              FLA frontend's opaque ops and layers against FLA's kernels, and (fla-backward-ahead) the FLA ops'
#              backward compiled ahead: no FLA compile on the step's thread in the backward, gradients at the reference
#   chunk-gdn  GDN's chunk_bench.py tables: every policy at the three shapes (with FLA's fwd+bwd past its Hopper guard,
#              timing only, and the fp32 torch emulation up to [1,4096,16,128]), the kernels of the main rows at
#              [8,4096,16,128], and the setting rows there (residual modes)
#   chunk-kda  the same for KDA, and head_k 256 at [1,4096,16,256]
#   decode     decode_bench.py: the decode kernels' accuracy against the fp64 decode reference, then KDA
#              [1,257,4,128] prefix 64 and [2,4096,8,128] prefix 2048 fwd+bwd per policy at 4 and 8 warps against FLA's
#              chunk_kda, kernels split; then (kernels31) every decode mode and serving recipe, GDN and KDA, at
#              [1,4096,16,128] prefix 2048 against FLA's chunk fwd+bwd and fused recurrent forward, timed interleaved;
#              then (profile) decode_profile.py: each decode kernel's time, and sweeps of their launch settings
#   recurrent  recurrent_vs_fla.py: the fused recurrent kernels' exactness, then both kinds against FLA's kernels
#   model      model_bench.py: FLA's causal LMs, one training step per row (eager FLA, Inductor, laqat under every
#              shipped recipe), all rows of a family in one process and timed interleaved; then the exact rows'
#              gradients against the fp32 oracle; then (regional) eager FLA against laqat exact with its repeated layers
#              compiled once in runs of four layers (the default; a 4-layer LM compiles whole) and a piece per layer,
#              at 4 layers; (regional-16-kda, regional-16-gdn) eager FLA against the default and one graph at 16
#              layers (hidden 2048), a family per part (FLA's cold searches of eager FLA's 16-layer step take ~4 min)
#   compile    compile_account.py: where the first two training steps of the model benchmark's laqat exact rows spend
#              their time (every Triton compile and autotuning search, torch's compile phases), GDN and KDA at 4
#              layers and at 16 (hidden 2048), each cold (empty caches under COLD_ROOT, default a fresh temporary folder) and
#              then warm (a second process on the first's caches); GDN at 16 layers also compiled as one graph (the
#              "laqat exact (whole graph)" row: options regional=False); KDA at 4 layers also with each kernel readied at its
#              first launch (--ready-on-first-launch), GDN and KDA at 4 layers with FLA's backward kernels compiled at
#              their first launches (LAQAT_FLA_COMPILE_AHEAD=off) and, at hidden 1536, with FLA's full searches (how close the
#              narrowed searches come to every candidate at a shape they were not chosen from)
#   serving    serving_parity_gpu.py: the serving profiles against vLLM 0.33.0's own kernels, every case of
#              docs/serving.md's section 5 (the packed decode step, vLLM's recurrent kernel, whole sequences, one layer
#              from raw projections, forward: server and forward: laqat), the server's pre-processing and the GDN and KDA
#              layer tests and the SM90 layout check (layer), then decode_bench.py's interleaved fwd+bwd timing of
#              the serving recipes against FLA's exact chunk kernels (timing); VLLM_SRC= the directory that
#              `python -m tests.serving.vllm_oracle --prepare DIR` printed (where the package index is reachable)
#   train      train_fp8_state_gpu.py (a GDN + KDA model trains through the chunk kernels with an FP8 state) and
#              compiled_step_vs_eager.py (compiled FLA models' training step against eager)
#
# A fresh machine: `examples/benchmarks/gpu_chores.sh warm` first if FLA's KDA kernels are to be compiled in the
# background (time nothing while it runs), `gpu_chores.sh pack` at the end to carry the compile caches to the next
# machine as .gpu-cache/ (gpu_chores.sh says more). This script runs `gpu_chores.sh setup` itself. Each part has a
# time limit; a device that caps a command's time takes one suite (or part) per command.
# Afterwards, on any machine: `python examples/benchmarks/results/record.py $OUT --run YYYY-MM-DD-NN --write` turns the
# JSON into records, `python examples/benchmarks/results/render.py` regenerates docs/performance.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
B=examples/benchmarks
CB="python3 $B/chunk_bench.py"
POLICIES="laqat exact,laqat FP8 state,laqat INT8 state,laqat FP8 state + W,laqat FP8 all sites,laqat NVFP4 operands"
MAIN="laqat exact,laqat FP8 state,laqat FP8 all sites,laqat NVFP4 operands"
SETTINGS="laqat exact,laqat exact (no residual),laqat exact (keep all),laqat FP8 state,laqat FP8 state (keep all),\
laqat FP8 all sites,laqat FP8 all sites (no residual),laqat FP8 all sites (keep all)"
QDQ="python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qdq_triton.py"

quote() {  # the arguments as one shell line, quoting only those that need it
  local a out=()
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=,+-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}

part() {  # part NAME SECONDS [VAR=value ...] COMMAND ...: one part of the current suite
  local name=$1 limit=$2 env=() dir
  shift 2
  while [[ $1 =~ ^[A-Z_]+= ]]; do env+=("$1"); shift; done
  [[ -n $ONLY && $ONLY != "$name" ]] && return 0
  FOUND=1
  dir=$OUT/$SUITE/$name
  if [[ $MODE == list ]]; then
    echo "  $SUITE:$name"
    return 0
  fi
  if [[ $MODE == dry ]]; then
    echo "$SUITE:$name (timeout ${limit}s): OUT=$dir $(quote "${env[@]}" "$@")"
    return 0
  fi
  mkdir -p "$dir"
  quote "${env[@]}" "$@" >"$dir/command.txt"
  echo "=== $SUITE:$name $(date +%T)"
  env OUT="$dir" "${env[@]}" timeout "$limit" "$@" 2>&1 | tee "$dir/$name.log"
  echo "=== $SUITE:$name exit ${PIPESTATUS[0]} $(date +%T)"
}

suite_exactness() {
  part chunk-exact 480 $CB --exactness-only --exact-cases 0,1,2,3,6,8
  part chunk-rounded 480 $CB --exactness-only --exact-cases 4,5,7,9,10
  part chunk-all-sites 540 $CB --exactness-only --exact-cases 11,12
  part fla-equality 300 $CB --fla-equality kda:1x4096x16x128,gdn:1x4096x16x128
  part qdq 150 $QDQ --junitxml="$OUT/exactness/qdq/junit.xml"
  part fla-frontend 300 python3 $B/fla_frontend_gpu_check.py
  part fla-backward-ahead 300 python3 $B/fla_backward_ahead_gpu_check.py
}

chunk_suite() {  # chunk_suite KIND [extra chunk_bench options]: the chunk-gdn / chunk-kda parts
  local kind=$1
  shift
  part table 540 $CB --skip-exactness --kinds "$kind" --policies "$POLICIES" --no-emulation-above 65536 "$@"
  part kernels 420 $CB --skip-exactness --kinds "$kind" --shapes 8x4096x16x128 --policies "$MAIN" \
    --no-emulation-above 0 --profile "FLA exact,$MAIN" "$@"
  part settings 540 $CB --skip-exactness --kinds "$kind" --shapes 8x4096x16x128 --policies "$SETTINGS" \
    --no-emulation-above 0 "$@"
}

suite_chunk-gdn() { chunk_suite gdn --lift-fla-gdn-guard; }

suite_chunk-kda() {
  chunk_suite kda
  part head-k-256 300 $CB --skip-exactness --kinds kda --shapes 1x4096x16x256 --policies "laqat exact,laqat FP8 state" \
    --no-emulation-above 0 --profile "laqat exact"
}

suite_decode() {
  part accuracy-and-timing 540 python3 $B/decode_bench.py --sections accuracy timing --num-warps 4 8 --profile
  part kernels31 540 python3 $B/decode_bench.py --sections compare --rounds 30 --budget-s 500
  part profile 540 python3 $B/decode_profile.py
}

suite_recurrent() {
  part exactness-and-timing 420 python3 $B/recurrent_vs_fla.py
}

suite_model() {
  part recipes-kda 540 python3 $B/model_bench.py --family kda --no-oracle --rounds 10 --budget-s 480
  part recipes-gdn 540 python3 $B/model_bench.py --family gdn --no-oracle --rounds 10 --budget-s 480 \
    --lift-fla-gdn-guard
  part gradients 540 python3 $B/model_bench.py --family gdn kda --rows "laqat exact"
  part regional 540 python3 $B/model_bench.py --family kda gdn --no-oracle --rounds 10 --lift-fla-gdn-guard \
    --rows "eager FLA,laqat exact,laqat exact (1 layer per piece)"
  part regional-16-kda 540 python3 $B/model_bench.py --family kda --no-oracle --rounds 10 --layers 16 --hidden 2048 \
    --heads 16 --budget-s 480 --rows "eager FLA,laqat exact,laqat exact (whole graph)"
  part regional-16-gdn 540 python3 $B/model_bench.py --family gdn --no-oracle --rounds 10 --layers 16 --hidden 2048 \
    --heads 16 --budget-s 480 --lift-fla-gdn-guard --rows "eager FLA,laqat exact,laqat exact (whole graph)"
}

suite_serving() {
  part parity 400 python3 $B/serving_parity_gpu.py --vllm-src "${VLLM_SRC:-out/vllm-oracle/src}"
  part layer 300 VLLM_SRC="${VLLM_SRC:-out/vllm-oracle/src}" python3 -m pytest -q -p no:cacheprovider \
    tests/serving/test_serving_inputs.py tests/serving/test_serving_kda_inputs.py tests/serving/test_sm90_layouts.py
  part timing 480 python3 $B/decode_bench.py --sections compare --compare-rows "FLA chunk exact,vllm serving recipe" \
    --rounds 30 --budget-s 420
}

compile_caches() {  # compile_caches NAME: Triton's, laqat's and Inductor's cache folders of one cold measurement
  local dir=$COLD_ROOT/$1
  echo "TRITON_CACHE_DIR=$dir/triton" "LAQAT_CACHE_DIR=$dir/laqat" "TORCHINDUCTOR_CACHE_DIR=$dir/inductor"
}

suite_compile() {
  COLD_ROOT=${COLD_ROOT:-$(mktemp -d -t laqat-cold-XXXX)}
  local CA="python3 $B/compile_account.py --steps 2"
  # shellcheck disable=SC2046
  part gdn-cold 300 $(compile_caches gdn) $CA --family gdn --row "laqat exact" --caches cold
  # shellcheck disable=SC2046
  part gdn-warm 120 $(compile_caches gdn) $CA --family gdn --row "laqat exact" --caches warm
  # shellcheck disable=SC2046
  part kda-cold 300 $(compile_caches kda) $CA --family kda --row "laqat exact" --caches cold
  # shellcheck disable=SC2046
  part kda-warm 120 $(compile_caches kda) $CA --family kda --row "laqat exact" --caches warm
  # shellcheck disable=SC2046
  part kda-cold-fla-ahead-off 300 $(compile_caches kda-fla-off) LAQAT_FLA_COMPILE_AHEAD=off $CA --family kda \
    --row "laqat exact" --caches cold
  # shellcheck disable=SC2046
  part gdn-cold-fla-ahead-off 300 $(compile_caches gdn-fla-off) LAQAT_FLA_COMPILE_AHEAD=off $CA --family gdn \
    --row "laqat exact" --caches cold
  # shellcheck disable=SC2046
  part kda-cold-ready-on-launch 300 $(compile_caches kda-on-launch) $CA --family kda --row "laqat exact" --caches cold \
    --ready-on-first-launch
  # shellcheck disable=SC2046
  part kda-1536-full-searches 400 $(compile_caches kda1536) $CA --family kda --row "laqat exact" --hidden 1536 \
    --heads 12 --caches cold --full-searches
  # shellcheck disable=SC2046
  part gdn-16-cold 400 $(compile_caches gdn16) $CA --family gdn --row "laqat exact" --layers 16 --hidden 2048 \
    --heads 16 --caches cold
  # shellcheck disable=SC2046
  part gdn-16-warm 120 $(compile_caches gdn16) $CA --family gdn --row "laqat exact" --layers 16 --hidden 2048 \
    --heads 16 --caches warm
  # shellcheck disable=SC2046
  part gdn-16-cold-whole 400 $(compile_caches gdn16-whole) $CA --family gdn --row "laqat exact (whole graph)" \
    --layers 16 --hidden 2048 --heads 16 --caches cold
  # shellcheck disable=SC2046
  part kda-16-cold 400 $(compile_caches kda16) $CA --family kda --row "laqat exact" --layers 16 --hidden 2048 \
    --heads 16 --caches cold
  # shellcheck disable=SC2046
  part kda-16-warm 120 $(compile_caches kda16) $CA --family kda --row "laqat exact" --layers 16 --hidden 2048 \
    --heads 16 --caches warm
}

suite_train() {
  part fp8-state 400 python3 $B/train_fp8_state_gpu.py
  part compiled-step 440 python3 $B/compiled_step_vs_eager.py
}

SUITES=(exactness chunk-gdn chunk-kda decode recurrent model compile serving train)
MODE=run
case ${1:-} in
  --list) MODE=list; shift; [ $# -gt 0 ] || set -- "${SUITES[@]}" ;;
  --dry-run) MODE=dry; shift ;;
  ""|-h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 2 ;;
esac
[ $# -gt 0 ] || { echo "name a suite: ${SUITES[*]} (or --list)" >&2; exit 2; }
for item in "$@"; do
  [[ " ${SUITES[*]} " == *" ${item%%:*} "* ]] || { echo "unknown suite '${item%%:*}': ${SUITES[*]}" >&2; exit 2; }
done
export OUT=${OUT:-out}
if [[ $MODE == run ]]; then
  source $B/gpu_chores.sh
  chores_setup || exit 1
fi
for item in "$@"; do
  SUITE=${item%%:*} ONLY=${item#"$SUITE"} ONLY=${ONLY#:} FOUND=0
  [[ $MODE == list ]] && echo "$SUITE"
  "suite_$SUITE"
  (( FOUND )) || { echo "suite $SUITE has no part '$ONLY' (--list $SUITE)" >&2; exit 2; }
done
[[ $MODE == run ]] && echo "next: python $B/results/record.py $OUT --run $(date +%F)-NN --write; python $B/results/render.py"
exit 0
