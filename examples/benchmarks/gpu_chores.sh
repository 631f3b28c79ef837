#!/usr/bin/env bash
# The machine chores around laqat's GPU suites (examples/benchmarks/run_gpu.sh), run from the repository root of a
# CUDA machine whose torch and triton are preinstalled:
#   examples/benchmarks/gpu_chores.sh setup    FLA's wheels from .whl/ (if any) into a scratch site directory, laqat
#                                               installed editable, the compile caches of an earlier machine restored
#                                               from .gpu-cache/caches.tgz.* (if any), $OUT/machine.json written
#   examples/benchmarks/gpu_chores.sh warm     compile and autotune FLA's KDA kernels in the background (warm_fla.py,
#                                               one detached process per group): later FLA rows find them in Triton's
#                                               cache. It shares the GPU: time nothing while it runs
#   examples/benchmarks/gpu_chores.sh pack     the compile caches (Triton's cubins and FLA's autotune choices,
#                                               laqat's autotune choices, Inductor's FX graph and AOTAutograd entries)
#                                               to $OUT/caches.tgz.* in 15 MB pieces: carried back as .gpu-cache/, a
#                                               later machine skips minutes of compiling. Inductor's entries go only
#                                               while the archive stays within CACHE_MB MB (default 48: a carry holds
#                                               64 MiB in all); a later process hits them (their keys hold laqat's
#                                               sources and policy: docs/options.md, "Inductor's caches")
#   examples/benchmarks/gpu_chores.sh bundle   every log and JSON under $OUT into $OUT/results.tgz (for a device that
#                                               returns few files)
# Several chores run in order: `gpu_chores.sh setup warm`. run_gpu.sh sources this file and runs `setup` itself.
# The caches live at one fixed absolute place under the system's temporary directory (LAQAT_GPU_CACHE overrides it):
# Triton's cache index records absolute file paths, so a restored cache must land where it was packed.
set -uo pipefail

chores_paths() {
  export OUT=${OUT:-out} PYTHONUNBUFFERED=1
  local tmp
  tmp=$(python3 -c 'import tempfile; print(tempfile.gettempdir())')
  GPU_SCRATCH=${LAQAT_GPU_SCRATCH:-$tmp/laqat-gpu}
  CACHE=${LAQAT_GPU_CACHE:-$tmp/laqat-gpu-cache}
  export TRITON_CACHE_DIR=$CACHE/triton LAQAT_CACHE_DIR=$CACHE/laqat TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor
  mkdir -p "$OUT" "$GPU_SCRATCH"
}

chores_setup() {
  chores_paths
  if ls .gpu-cache/caches.tgz.* >/dev/null 2>&1 && [ ! -d "$CACHE" ]; then
    cat .gpu-cache/caches.tgz.* | tar xzf - -C / && echo "restored compile caches: $(du -sh "$CACHE" | cut -f1)"
  fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$GPU_SCRATCH/site" .whl/*.whl
    export PYTHONPATH=$GPU_SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; return 1; }
  python3 - "$OUT/machine.json" <<'EOF'
import json, os, subprocess, sys
import torch, triton
try:
    import fla
    fla_version = getattr(fla, "__version__", "unknown")
except ImportError:
    fla_version = None
commit = os.environ.get("LAQAT_COMMIT") or subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None
cuda = torch.cuda.is_available()
info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__, "triton": triton.__version__, "fla": fla_version, "commit": commit}
open(sys.argv[1], "w").write(json.dumps(info, indent=1))
print(" ".join(f"{k} {v}" for k, v in info.items()))
EOF
}

chores_warm() {
  chores_paths
  local group
  for group in bf16-128 bf16-64 fp32-64; do
    setsid nohup python3 examples/benchmarks/warm_fla.py --group "$group" >"$OUT/warm_$group.log" 2>&1 </dev/null &
    echo "warm_fla.py --group $group: process $!"
  done
}

chores_pack() {  # Triton's cubins, metadata and launchers only (the IR text is 80% of its cache); Inductor's if it fits
  chores_paths
  local archive=$GPU_SCRATCH/caches.tgz mb without
  for without in "" "--exclude=inductor"; do
    # shellcheck disable=SC2086
    tar czf "$archive" -C / --exclude='*.llir' --exclude='*.ptx' --exclude='*.ttir' --exclude='*.ttgir' \
      --exclude='*.source' $without "${CACHE#/}"
    mb=$(( $(stat -c %s "$archive") / 1048576 ))
    echo "compile caches ($([ -n "$without" ] && echo "without" || echo "with") Inductor's): $mb MB"
    (( mb <= ${CACHE_MB:-48} )) && break
  done
  rm -f "$OUT"/caches.tgz.*
  split -b 15m "$archive" "$OUT/caches.tgz." && rm -f "$archive"
  ls -l "$OUT"/caches.tgz.*
}

chores_bundle() {
  chores_paths
  (cd "$OUT" && tar czf "$GPU_SCRATCH/results.tgz" --exclude='caches.tgz.*' --exclude=results.tgz . \
    && mv "$GPU_SCRATCH/results.tgz" . && ls -l results.tgz)
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  [ $# -gt 0 ] || { sed -n '2,21p' "$0"; exit 2; }
  for chore in "$@"; do
    case $chore in
      setup|warm|pack|bundle) "chores_$chore" || exit 1 ;;
      *) echo "unknown chore '$chore' (setup, warm, pack, bundle)" >&2; exit 2 ;;
    esac
  done
fi
