#!/usr/bin/env bash
# One entry point: set-up (idempotent), then the main job, the tests or the benchmarks.
#
#   ./run.sh [ARGS...]              train: the speedrun on CUDA GPUs, the CPU demo (2 gloo processes)
#                                   otherwise; ARGS pass through to train_gpt.py
#   ./run.sh test [ARGS...]         the whole pytest suite (ARGS pass through to pytest)
#   ./run.sh test-oldest [ARGS...]  the quick tests (-m "not slow") on the oldest supported torch and
#                                   triton (requirements-oldest.txt, in .venv-oldest); ARGS pass through
#                                   to pytest (a -m of their own replaces "not slow")
#   ./run.sh --dry-run [ARGS]       set up, then print the launch command instead of running it
#   ./run.sh bench [ARGS...]        kernel and optimizer benchmarks, then timed training steps of every
#                                   stage (ms/step, tokens/s, MFU, peak memory, projected run time); ARGS
#                                   pass through to tests/benchmarks/step_timing.py. On a CPU-only machine:
#                                   the CPU benchmarks and a short demo-preset timing. Both print the
#                                   committed token-efficiency and ablation tables (records/) and the host
#                                   dispatches of one training step (tests/benchmarks/host_dispatch.py,
#                                   counted on CPU tensors on any machine) and the calls from the training
#                                   loop to each Triton kernel (tests/benchmarks/call_depth.py, read from
#                                   the source).
#                                   `./run.sh bench --dry-run` lists them.
#   ./run.sh gpu-check [ARGS...]    every CUDA path checked on this machine's GPU, then the speedrun's step
#                                   times; report in records/gpu_check/ (tests/README.md "GPU check"). Uses
#                                   PYTHON or python3 as it is (no .venv, no install); `--dry-run` lists
#                                   the checks and `--plan` prints the next lease's commands (run them with
#                                   `--lease N`) on any machine. ARGS pass through to tests/gpu_check.py.
#
# Interpreter. By default run.sh makes .venv here (python3 -m venv, Python >= 3.10) and installs the
# pinned requirements into it when they are not already met; it never installs anywhere else.
# PYTHON=/path/to/python uses that interpreter as it is, with no install at all (for a machine with a
# preinstalled CUDA torch): it must have torch >= 2.11, triton >= 3.6, numpy and tiktoken, and for
# `test` also pytest, scipy and matplotlib, or run.sh stops saying what is missing.
# On a machine with an NVIDIA GPU (nvidia-smi lists one) .venv gets the stack the GPU check last passed
# on, requirements-gpu.txt (torch 2.11.0; `test` adds the test tools: requirements-oldest.txt); elsewhere
# requirements.txt (torch 2.14.1; `test`: requirements-dev.txt). `--dry-run` prints which ("pins:").
# NPROC: processes to launch (default: number of GPUs, or 2 on a CPU-only machine).
set -euo pipefail
cd "$(dirname "$0")"

die() { echo "run.sh: $*" >&2; exit 1; }

mode=train
dry_run=0
case ${1:-} in test | test-oldest | bench | gpu-check) mode=$1; shift ;; esac
if [[ $mode != test* && $mode != gpu-check && ${1:-} == --dry-run ]]; then dry_run=1; shift; fi

# "X.Y" of interpreter $1, exit status 1 when it is older than 3.10 (2 when it does not run at all).
python_version() {
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2]); sys.exit(sys.version_info < (3, 10))' 2>/dev/null
}

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

# Prints what interpreter $PY lacks of the given modules ("name" or "name>=X.Y"), exit status 1 if
# anything; prints nothing, status 0, when all are there.
missing_modules() {
  "$PY" - "$@" 2>/dev/null <<'PYEOF'
import importlib, importlib.util, re, sys
from importlib import metadata
dists = metadata.packages_distributions()  # module -> distributions ('triton' may be 'pytorch-triton')
missing = []
for spec in sys.argv[1:]:
    name, _, minimum = spec.partition(">=")
    if importlib.util.find_spec(name) is None:
        missing.append(spec)
        continue
    if not minimum:
        continue
    version = None
    for dist in dists.get(name, []) + [name]:
        try:
            version = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            pass
    if version is None:
        try:
            version = importlib.import_module(name).__version__
        except Exception as e:
            missing.append(f"{spec} (import failed: {type(e).__name__})")
            continue
    have = re.match(r"(\d+)\.(\d+)", version)
    want = tuple(int(x) for x in minimum.split("."))
    if have is None or tuple(int(x) for x in have.groups()) < want:
        missing.append(f"{spec} (has {version})")
if missing:
    print(", ".join(missing))
    sys.exit(1)
PYEOF
}

# PYTHON=...: use that interpreter as it is. Checks only; installs nothing.
use_given_python() {
  local version missing
  PY=$PYTHON
  [[ $mode == test-oldest ]] && die "test-oldest makes and uses its own .venv-oldest (torch 2.11); unset PYTHON"
  command -v "$PY" >/dev/null || die "PYTHON=$PY is not an executable; point it at a Python >= 3.10, or unset PYTHON to use .venv"
  version=$(python_version "$PY") ||
    die "PYTHON=$PY is Python ${version:-?}, not >= 3.10; point PYTHON at a newer one, or unset PYTHON to use .venv"
  local need=("torch>=2.11" "triton>=3.6" numpy tiktoken)
  [[ $mode == test ]] && need+=(pytest scipy matplotlib)
  missing=$(missing_modules "${need[@]}") ||
    die "PYTHON=$PY lacks ${missing:-the required packages}; install them there (pins: requirements*.txt), or unset PYTHON to use .venv"
}

# Default: make $1 (a venv here) if absent, then install $2 into it unless already met.
use_venv() {
  local venv=$1 req=$2 version
  PY=$venv/bin/python
  if [[ -x $PY ]]; then
    version=$(python_version "$PY") ||
      die "$venv has Python ${version:-?}, not >= 3.10; remove $venv and run again with python3 >= 3.10 on PATH"
  else
    command -v python3 >/dev/null ||
      die "no python3 on PATH to make $venv; install Python >= 3.10, or set PYTHON=/path/to/python with the packages"
    version=$(python_version python3) ||
      die "python3 is Python ${version:-?}, $venv needs >= 3.10; put a newer python3 first on PATH, or set PYTHON=/path/to/python with the packages"
    echo "run.sh: creating $venv (python3 -m venv, $(command -v python3), Python $version)" >&2
    local existed=0
    [[ -e $venv ]] && existed=1
    if ! python3 -m venv "$venv"; then
      (( existed )) || rm -rf "$venv"
      die "python3 -m venv $venv failed (Debian/Ubuntu: apt-get install python3-venv)"
    fi
  fi
  if requirements_met "$req"; then return; fi
  echo "run.sh: installing $req into $venv (pip's own progress follows)" >&2
  local start=$SECONDS
  "$PY" -m pip install -r "$req" || die "pip install -r $req into $venv failed (see above)"
  echo "run.sh: installed $req into $venv in $((SECONDS - start)) s" >&2
}

if [[ $mode == gpu-check ]]; then
  # The GPU machines come with their own CUDA torch: use it as it is, never a venv or an install.
  PY=${PYTHON:-python3}
  command -v "$PY" >/dev/null || die "gpu-check: ${PY} is not an executable; set PYTHON=/path/to/python with torch >= 2.11"
  python_version "$PY" >/dev/null || die "gpu-check: $PY is not Python >= 3.10; set PYTHON=/path/to/python with torch >= 2.11"
  if [[ " $* " != *" --dry-run "* && " $* " != *" --plan "* ]]; then  # the list and the plan need no packages; the checks do
    missing=$(missing_modules "torch>=2.11" "triton>=3.6" numpy) ||
      die "gpu-check: $PY lacks ${missing:-the required packages}; set PYTHON=/path/to/python with them"
  fi
  exec "$PY" tests/gpu_check.py "$@"
fi

# True on a machine with an NVIDIA GPU that CUDA may use (nvidia-smi lists one; CUDA_VISIBLE_DEVICES is
# not set empty). Asked before any torch is installed, so without torch.
nvidia_gpu() {
  [[ ${CUDA_VISIBLE_DEVICES-unset} != "" ]] && command -v nvidia-smi >/dev/null &&
    nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

# Pins. On a machine with an NVIDIA GPU: the stack the GPU check last passed on (requirements-gpu.txt,
# torch 2.11.0), so a GPU run uses the stack of the recorded GPU figures; elsewhere the newest pins.
if nvidia_gpu; then
  stack=gpu
  case $mode in
    test | test-oldest) req=requirements-oldest.txt ;;  # the GPU stack plus the test tools
    *) req=requirements-gpu.txt ;;
  esac
else
  stack=newest
  case $mode in
    test) req=requirements-dev.txt ;;
    test-oldest) req=requirements-oldest.txt ;;
    *) req=requirements.txt ;;
  esac
fi
if [[ -n ${PYTHON:-} ]]; then
  use_given_python
elif [[ $mode == test-oldest ]]; then
  use_venv .venv-oldest "$req"
else
  use_venv .venv "$req"
fi

# CPU training: glibc hands every large freed block back to the OS, so each step page-faults its
# (T, 50304) logits and gradients in again; keeping freed memory in the heap makes CPU steps ~20% faster.
# train_gpt.py sets the same on a CPU itself (keep_freed_memory); this covers every script run.sh starts.
keep_freed_memory() {
  export MALLOC_MMAP_MAX_=${MALLOC_MMAP_MAX_:-0} MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-68719476736}
}

if [[ $mode == test ]]; then
  exec "$PY" -m pytest "$@"
fi

if [[ $mode == test-oldest ]]; then
  "$PY" -c 'import sys, torch, triton; print(f"test-oldest: Python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}")'
  exec "$PY" -m pytest -m "not slow" "$@"
fi

if [[ $mode == bench ]]; then
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
  py=$(printf '%q' "$PY")  # the commands below are strings (printed, then eval'ed)
  # The token-efficiency and ablation tables of the committed results (records/README.md "Token
  # efficiency"): printed, not re-trained (that takes hours on a CPU; the commands are in records/README.md).
  benches=("$py tests/bench_kernels.py" "$py tests/bench_optimizer.py"
           "$py tests/benchmarks/token_efficiency.py --load records/token_efficiency_sympy_500K --no_plot"
           "$py tests/benchmarks/token_efficiency.py --load records/token_efficiency_tinyshakespeare_500K --no_plot"
           "$py tests/benchmarks/stage_rise.py --table records/stage_rise"
           "$py tests/benchmarks/host_dispatch.py" "$py tests/benchmarks/call_depth.py")
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
  if [[ -n ${PYTHON:-} ]]; then echo "pins: none installed (PYTHON=$PYTHON as it is)"; else echo "pins: $req ($stack stack)"; fi
  if (( ${#fetch[@]} )); then echo "fetch: ${fetch[*]}"; fi
  echo "launch: ${cmd[*]}"
  exit 0
fi
if (( ${#fetch[@]} )); then "${fetch[@]}"; fi
exec "${cmd[@]}"
