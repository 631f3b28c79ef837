#!/usr/bin/env bash
# The quality study (examples/qat/study.py) on one CUDA machine in two commands, each inside ~9 minutes, from the
# repository root (FLA's wheels in .whl/: ../shared/tools/device-wheels fetches them):
#
#   examples/qat/gpu_study.sh pretrain   set-up; pretraining with exact numerics (~3 min) while background processes
#                                        compile every policy at the study's shapes; then the compile caches in
#                                        $OUT/caches.tgz.* (at most CACHE_MB MB, 15 MB pieces). Returns
#                                        pretrained.pt, pretrain.json, logs.tgz (logs, curves) and the cache pieces.
#   examples/qat/gpu_study.sh finetune   set-up with the carried caches; the finetune stage from
#                                        .gpu-cache/pretrained.pt: the table, study.json, study.md, runs.jsonl,
#                                        curves.png, study.log.
#
#   examples/qat/gpu_study.sh state      the state-cache study (study.py --preset state-cache) in one command: set-up,
#                                        pretraining and the first seed's runs, inside STATE_BUDGET_S (default 470) s;
#                                        the prose tarballs from .gpu-cache/prose/ (examples/qat/prose.py --fetch). Its
#                                        working folder out/state-study/ stays on the machine (pretrained.pt)
#   examples/qat/gpu_study.sh state-seed N   the finetune stage of seed N from out/state-study/pretrained.pt, on
#                                        the same machine while it is still held (within its idle time)
#
# Between the two, copy what the first returned (pretrained.pt and caches.tgz.*) into .gpu-cache/ (git-ignored:
# `echo /.gpu-cache/ >> .git/info/exclude`) and carry .whl and .gpu-cache (64 MiB in all: the checkpoint is ~11 MB).
# Extra arguments go to study.py (e.g. --finetune-steps 300). OUT defaults to ./out.
set -uo pipefail
cd "$(dirname "$0")/../.."
stage=${1:-}
shift || true
source examples/benchmarks/gpu_chores.sh  # chores_setup: FLA's wheels, laqat, caches from .gpu-cache/
CACHE_MB=${CACHE_MB:-48}

pack_caches() {  # Triton's cubins, laqat's sources and Inductor's graphs (no IR text); without Inductor's if too big
  local archive=$GPU_SCRATCH/caches.tgz mb
  for without in "" "--exclude=inductor"; do
    # shellcheck disable=SC2086
    tar czf "$archive" -C / --exclude='*.llir' --exclude='*.ptx' --exclude='*.ttir' --exclude='*.ttgir' \
      --exclude='*.source' $without "${CACHE#/}"
    mb=$(( $(stat -c %s "$archive") / 1048576 ))
    echo "compile caches ($([ -n "$without" ] && echo "without" || echo "with") the Inductor graphs): $mb MB"
    if (( mb <= CACHE_MB )); then
      split -b 15m "$archive" "$OUT/caches.tgz." && ls -l "$OUT"/caches.tgz.*
      return 0
    fi
  done
  echo "the compile caches exceed $CACHE_MB MB: not returned (the finetune command then compiles cold)"
}

case $stage in
  pretrain)
    chores_setup || exit 1
    python3 examples/qat/study.py --stage pretrain --out "$OUT" "$@" 2>&1 | tee "$OUT/study.log"
    status=${PIPESTATUS[0]}
    pack_caches
    (cd "$OUT" && tar czf logs.tgz study.log pretrain.jsonl pretrain.png warm*.log install.log machine.json 2>/dev/null
     rm -f warm*.log pretrain.jsonl pretrain.png install.log machine.json study.log)
    ls -l "$OUT"
    echo "command seconds: $SECONDS"
    exit "$status"
    ;;
  finetune)
    [ -f .gpu-cache/pretrained.pt ] || { echo ".gpu-cache/pretrained.pt: carry the pretrain command's checkpoint"; exit 2; }
    chores_setup || exit 1
    python3 examples/qat/study.py --stage finetune --from .gpu-cache/pretrained.pt --out "$OUT" "$@" 2>&1 \
      | tee "$OUT/study.log"
    status=${PIPESTATUS[0]}
    rm -f "$OUT/install.log"
    ls -l "$OUT"
    echo "command seconds: $SECONDS"
    exit "$status"
    ;;
  state|state-seed)
    chores_setup || exit 1
    work=out/state-study
    if [ "$stage" = state ]; then
      args=(--stage all --out "$work")
    else
      seed=${1:?state-seed: give the seed}; shift
      [ -f "$work/pretrained.pt" ] || { echo "$work/pretrained.pt: not on this machine (run the state stage)"; exit 2; }
      args=(--stage finetune --from "$work/pretrained.pt" --seeds "$seed" --out "$work-seed$seed")
      work=$work-seed$seed
    fi
    timeout $(( ${STATE_BUDGET_S:-470} + 60 )) python3 examples/qat/study.py --preset state-cache \
      --corpus-dir .gpu-cache/prose --budget-s "${STATE_BUDGET_S:-470}" "${args[@]}" "$@" 2>&1 | tee "$OUT/study.log"
    status=${PIPESTATUS[0]}
    cp "$work"/study.json "$work"/study.md "$work"/positions.png "$work"/curves.png "$work"/pretrain.json "$OUT"/ \
      2>/dev/null
    out=$(realpath "$OUT")
    (cd "$work" && tar czf "$out/logs.tgz" $(ls pretrain.jsonl pretrain.png runs.jsonl warm*.log 2>/dev/null) \
      -C "$out" study.log machine.json) && rm -f "$out"/study.log "$out"/machine.json "$out"/install.log
    ls -l "$OUT"
    echo "command seconds: $SECONDS"
    exit "$status"
    ;;
  *)
    sed -n '2,22p' "$0"
    exit 2
    ;;
esac
