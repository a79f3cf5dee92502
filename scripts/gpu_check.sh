#!/usr/bin/env bash
# The GPU device check (issue 12), in under 8 minutes on one CUDA or ROCm GPU:
#   1. a venv, .venv-gpu, that sees the machine's own torch (--system-site-packages), with
#      boo (editable, --no-deps) and its other pinned dependencies, offline from ./.whl/ when
#      that folder exists; torch is pinned to the version found, so pip never replaces it;
#   2. torch, CUDA/ROCm, the device and boo's IREE target for it (env.json);
#   3. pytest -m gpu: every composite on the GPU, a GPT-2 step, BOO_SYNC (pytest_gpu.xml);
#   4. the GPT-2 zoo training step timed, eager against boo (zoo.json);
#   5. boo-driver: layer norm, softmax, GELU and attention with the backends eager, inductor,
#      boo and boo-decomposed (driver_*.csv);
#   6. one summary table, with each row's verdict against the issue's targets (summary.txt).
# Every file lands in $OUT when set, else in gpu_check_results/. Without a GPU, or with
# --cpu-only, it runs 1, 2, the gpu tests (which skip) and 6 in seconds, and says so.
#
#   scripts/gpu_check.sh [--cpu-only]
#   BOO_GPU_CHECK_PYTHON=python   use that interpreter as it is: no venv, no install
#   BOO_GPU_CHECK_BUDGET_S=450    seconds for the whole run; each stage gets at most what is left
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
RESULTS=${OUT:-$ROOT/gpu_check_results}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
DEADLINE=$((SECONDS + ${BOO_GPU_CHECK_BUDGET_S:-450}))
SUMMARY_RESERVE_S=20
CPU_ONLY=0
case "${1:-}" in
    --cpu-only) CPU_ONLY=1 ;;
    "") ;;
    *) echo "usage: scripts/gpu_check.sh [--cpu-only]" >&2; exit 2 ;;
esac
# Driver commands: bandwidth-bound sizes on a big GPU; attention is -X BxHxLxD. One process
# per line, so that a crash loses only its own rows; bf16 first, in case time runs out.
DRIVER_COMMANDS=(
    "layer_norm -X 32768x4096 -t bf16 -F 15"
    "softmax -X 32768x4096 -t bf16 -F 3"
    "gelu -X 8192x8192 -t bf16 -F 3"
    "attention -X 8x16x1024x64 -t bf16 -F 3"
    "layer_norm -X 32768x4096 -t f32 -F 15"
    "softmax -X 32768x4096 -t f32 -F 3"
    "gelu -X 8192x8192 -t f32 -F 3"
)
DRIVER_BACKENDS=eager,inductor,boo,boo-decomposed
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's boo, whatever else is installed
export BOO_CACHE_DIR=${BOO_CACHE_DIR:-${TMPDIR:-/tmp}/boo-gpu-check-cache}

log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$RESULTS/gpu_check.log"; }
left() { echo $((DEADLINE - SECONDS - SUMMARY_RESERVE_S)); }
trap 'log "stopped: line $LINENO failed: $BASH_COMMAND"' ERR

printf 'stage\trc\tseconds\tlog\n' > "$RESULTS/stages.tsv"
# run_stage NAME LIMIT_S CMD...: CMD with its output in NAME.log and at most LIMIT_S seconds
# (less if less is left); a failure is recorded, shown and does not stop the run.
run_stage() {
    local name=$1 limit=$2 start=$SECONDS rc=0
    shift 2
    if [ "$(left)" -lt "$limit" ]; then limit=$(left); fi
    if [ "$limit" -lt 10 ]; then
        log "$name: skipped, the time budget is spent"
        printf '%s\tskipped\t0\t-\n' "$name" >> "$RESULTS/stages.tsv"
        return 0
    fi
    log "$name (at most ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1 || rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - start)) "$name.log" >> "$RESULTS/stages.tsv"
    if [ "$rc" -eq 0 ]; then
        log "$name: ok in $((SECONDS - start))s"
    else
        log "$name: FAILED (rc $rc$([ "$rc" -eq 124 ] && echo ', out of time')) in $((SECONDS - start))s; its last lines:"
        tail -n 15 "$RESULTS/$name.log" | sed 's/^/    /' | tee -a "$RESULTS/gpu_check.log"
    fi
}

# -- 1. Python: the given interpreter, or .venv-gpu over the machine's torch -----------------
install() {
    local py=$1 src=() deps
    if [ -d .whl ]; then
        src=(--no-index --find-links .whl)
        log "installing offline from .whl/ ($(find .whl -maxdepth 1 -type f | wc -l) files)"
    else
        log "installing from the package index (no .whl/ folder)"
    fi
    if "$py" -c 'import torch' 2>/dev/null; then
        "$py" -c 'import torch; print("torch==" + torch.__version__)' 2>/dev/null > "$RESULTS/constraints.txt"
        mapfile -t deps < <("$py" bench/gpu_probe.py deps)
    else
        : > "$RESULTS/constraints.txt"
        mapfile -t deps < <("$py" bench/gpu_probe.py deps --with-torch)
    fi
    # An editable install builds with the venv's setuptools: 70.1+ needs no `wheel` package.
    if ! "$py" -c 'import setuptools as s, sys; sys.exit(tuple(map(int, s.__version__.split(".")[:2])) < (70, 1))' 2>/dev/null; then
        deps+=("setuptools>=70.1")
    fi
    log "pip install -c constraints.txt ${deps[*]}"
    "$py" -m pip install --quiet "${src[@]}" -c "$RESULTS/constraints.txt" "${deps[@]}"
    log "pip install --no-deps --no-build-isolation -e ."
    "$py" -m pip install --quiet "${src[@]}" --no-deps --no-build-isolation -e .
}

setup_python() {
    if [ -n "${BOO_GPU_CHECK_PYTHON:-}" ]; then
        PY=$BOO_GPU_CHECK_PYTHON
        log "python: $PY as it is (BOO_GPU_CHECK_PYTHON): no venv, no install"
        return
    fi
    local base=${BOO_GPU_CHECK_BASE_PYTHON:-python3}
    log "system torch: $("$base" -c 'import torch; print(torch.__version__, "GPU" if torch.cuda.is_available() else "no GPU")' 2>/dev/null || echo none)"
    if [ ! -x .venv-gpu/bin/python ]; then
        # Without ensurepip (Debian's python3 without python3-venv) the system's pip serves.
        "$base" -m venv --system-site-packages .venv-gpu 2>/dev/null ||
            "$base" -m venv --system-site-packages --without-pip .venv-gpu
    fi
    PY=$ROOT/.venv-gpu/bin/python
    local before
    before=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
    if "$PY" -c 'import importlib.metadata as m; m.version("boo-backend")' 2>/dev/null &&
        "$PY" -c 'import iree.compiler, iree.runtime, torch_mlir, pytest, transformers' 2>/dev/null; then
        log "python: $PY, boo and its dependencies already installed"
    else
        install "$PY"
    fi
    local after
    after=$("$PY" -c 'import torch; print(torch.__version__)')
    if [ "$before" != none ] && [ "$before" != "$after" ]; then
        log "pip replaced torch $before with $after: stopping"
        exit 1
    fi
}

SETUP_START=$SECONDS
setup_python
log "install check: $("$PY" -c '
import importlib.metadata as m
print(", ".join(f"{d} {m.version(d)}" for d in ("torch", "iree-base-compiler", "iree-base-runtime", "torch-mlir", "transformers")))')"
printf 'setup\t0\t%s\tgpu_check.log\n' $((SECONDS - SETUP_START)) >> "$RESULTS/stages.tsv"

# -- 2. The device and its target -----------------------------------------------------------
run_stage env 60 "$PY" bench/gpu_probe.py env "$RESULTS/env.json"
sed 's/^/    /' "$RESULTS/env.log"
GPU=$("$PY" -c 'import json, sys; print(int(json.load(open(sys.argv[1])).get("gpu", False)))' "$RESULTS/env.json" 2>/dev/null || echo 0)

# -- 3-5. The device checks -----------------------------------------------------------------
if [ "$GPU" = 1 ] && [ "$CPU_ONLY" = 0 ]; then
    run_stage pytest_gpu 200 "$PY" -m pytest -m gpu -q -rfEs -p no:cacheprovider \
        --junitxml="$RESULTS/pytest_gpu.xml" tests
    run_stage zoo 90 "$PY" bench/gpu_probe.py zoo "$RESULTS/zoo.json" --model gpt2 --device cuda
    i=0
    for cmd in "${DRIVER_COMMANDS[@]}"; do
        i=$((i + 1))
        # shellcheck disable=SC2086 # the command's words
        run_stage "driver_$i" 120 "$PY" -m boo_backend.driver $cmd --backend "$DRIVER_BACKENDS" \
            --device cuda --csv "$RESULTS/driver_$i.csv"
    done
    rc=0
    "$PY" bench/gpu_summary.py "$RESULTS" | tee -a "$RESULTS/gpu_check.log" || rc=$?
    exit "$rc"
fi

# Quick mode: the gpu tests are collected and skip (the device hidden from them even where
# there is one); the summary shows what ran.
run_stage pytest_gpu 60 env CUDA_VISIBLE_DEVICES= HIP_VISIBLE_DEVICES= "$PY" -m pytest -m gpu -q -rfEs \
    -p no:cacheprovider --junitxml="$RESULTS/pytest_gpu.xml" tests/test_gpu_run.py
rc=0
"$PY" bench/gpu_summary.py "$RESULTS" --no-device | tee -a "$RESULTS/gpu_check.log" || rc=$?
if [ "$rc" -ne 0 ]; then
    log "a stage failed (see above); device checks not run"
elif [ "$GPU" = 1 ]; then
    log "--cpu-only: device checks not run"
else
    log "no GPU: device checks not run"
fi
exit "$rc"
