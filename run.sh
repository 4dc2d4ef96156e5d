#!/usr/bin/env bash
# One entry point: set-up (idempotent), then the main job, the tests or the benchmarks.
#
#   ./run.sh [ARGS...]        train: the speedrun on CUDA GPUs, the CPU demo (2 gloo processes) otherwise;
#                             ARGS pass through to train_gpt.py
#   ./run.sh test [ARGS...]   the whole pytest suite (ARGS pass through to pytest)
#   ./run.sh --dry-run [ARGS] set up, then print the launch command instead of running it
#   ./run.sh bench [ARGS...]  kernel and optimizer benchmarks, then timed training steps of every stage
#                             (ms/step, tokens/s, MFU, peak memory, projected run time); ARGS pass
#                             through to tests/benchmarks/step_timing.py. On a CPU-only machine: the CPU
#                             benchmarks and a short demo-preset timing. `./run.sh bench --dry-run` lists them.
#
# Environment: PYTHON (interpreter to use, default python3; a .venv here is used if present),
#              NPROC (processes to launch; default: number of GPUs, or 2 on a CPU-only machine).
set -euo pipefail
cd "$(dirname "$0")"

if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi

# True when every pinned 'name==version' line of the given requirements file (and its -r includes)
# is installed at that version, and every unpinned name is installed at all.
requirements_met() {
  "$PY" - "$1" <<'PYEOF'
import re, sys
from importlib import metadata
def lines(path):
    for line in open(path):
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            yield from lines(line[3:].strip())
        elif line:
            yield line
for req in lines(sys.argv[1]):
    name, _, version = req.partition("==")
    try:
        installed = metadata.version(name.strip())
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if version and installed.split("+")[0] != version.strip():
        sys.exit(1)
PYEOF
}

setup() {
  local req=$1
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "error: $PY is not Python >= 3.10; set PYTHON=/path/to/python3.11" >&2; exit 1
  fi
  if requirements_met "$req"; then return; fi
  echo "run.sh: installing $req into $("$PY" -c 'import sys; print(sys.prefix)')" >&2
  if ! "$PY" -m pip install -r "$req"; then
    # An externally managed system Python refuses installs: fall back to a private virtualenv.
    echo "run.sh: installing into $PY failed; creating .venv" >&2
    "$PY" -m venv .venv && PY=.venv/bin/python
    "$PY" -m pip install -r "$req"
  fi
}

# CPU training: glibc hands every large freed block back to the OS, so each step page-faults its
# (T, 50304) logits and gradients in again; keeping freed memory in the heap makes CPU steps ~20% faster.
keep_freed_memory() {
  export MALLOC_MMAP_MAX_=${MALLOC_MMAP_MAX_:-0} MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-68719476736}
}

mode=train
dry_run=0
if [[ ${1:-} == test ]]; then mode=test; shift; fi
if [[ ${1:-} == bench ]]; then mode=bench; shift; fi
if [[ ${1:-} == --dry-run ]]; then dry_run=1; shift; fi

if [[ $mode == test ]]; then
  setup requirements-dev.txt
  exec "$PY" -m pytest "$@"
fi

if [[ $mode == bench ]]; then
  setup requirements.txt
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
  py=$(printf '%q' "$PY")  # the commands below are strings (printed, then eval'ed)
  benches=("$py tests/bench_kernels.py" "$py tests/bench_optimizer.py")
  if (( gpus > 0 )); then
    # The speedrun preset reads the FineWeb train shards: fetch the first one if absent.
    benches=("$py data/cached_fineweb10B.py 1" "${benches[@]}"
             "$py -m torch.distributed.run --standalone --nproc_per_node=${NPROC:-$gpus} tests/benchmarks/step_timing.py")
  else
    keep_freed_memory
    benches+=("$py tests/benchmarks/step_timing.py --preset demo --steps 2 --warmup 0")
  fi
  echo "gpus: $gpus"
  last=$(( ${#benches[@]} - 1 ))
  for i in "${!benches[@]}"; do
    cmd=${benches[$i]}
    if (( i == last && $# )); then cmd="$cmd $(printf '%q ' "$@")"; fi
    if (( dry_run )); then echo "bench: $cmd"; continue; fi
    echo "==== $cmd"
    eval "$cmd"
  done
  if (( gpus == 0 )); then
    echo "GPU figures (kernel timings, the speedrun's ms/step, MFU, projected run time) need a CUDA GPU; this machine has none."
  fi
  exit 0
fi

setup requirements.txt
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
if (( gpus > 0 )); then
  cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-$gpus}" train_gpt.py "$@")
  fetch=("$PY" data/cached_fineweb10B.py 9)
else
  # No GPU: the CPU demo on the embedded tiny-Shakespeare shards, same code path over gloo.
  keep_freed_memory
  cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" train_gpt.py --preset demo "$@")
  fetch=()
fi
if (( dry_run )); then
  echo "gpus: $gpus"
  if (( ${#fetch[@]} )); then echo "fetch: ${fetch[*]}"; fi
  echo "launch: ${cmd[*]}"
  exit 0
fi
if (( ${#fetch[@]} )); then "${fetch[@]}"; fi
exec "${cmd[@]}"
