#!/usr/bin/env bash
# The device check: what a contributor runs on a machine with a GPU (one is enough), in
# under 12 minutes. Every step's output goes to its own log in one folder, with a summary.
#
#   benchmarks/gpu_check.sh [LOG_DIR]      # default ./gpu-logs
#
# Steps (each under its own time limit; the limits add up to 12 minutes):
#   1. pytest tests/gpu
#   2. the MPI + CuPy world tests at 2 ranks (both ranks on GPU 0)
#   3. benchmarks/bench_gpu.py --quick under mpiexec -n 2 (NCCL per-call latency, CuPy
#      through MPI host staging, FSDP on the GPU)
#   4. benchmarks/torch_gpu.py --quick, when torch is importable (the torch side-by-side)
#   5. the real-data examples with --device gpu (NCCL on one GPU; MPI with CuPy arrays
#      at 2 ranks), and the char LM's step time on the GPU against NumPy
# Without CuPy or a GPU it prints "no GPU" and exits 0. It exits 1 when a step failed.
# PYTHON (default: the python on PATH) and MPIEXEC (default: the one next to it, else on
# PATH) choose the interpreter and launcher.
set -u
cd "$(dirname "$0")/.."
LOGS=${1:-./gpu-logs}
PY=${PYTHON:-python}

if ! "$PY" -c "import cupy, sys; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 1)" \
        >/dev/null 2>&1; then
    echo "gpu_check: no GPU (CuPy is missing or sees no CUDA device): nothing to check"
    exit 0
fi
MPIEXEC=${MPIEXEC:-$(dirname "$(command -v "$PY")")/mpiexec}
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec || true)
mkdir -p "$LOGS"
SUMMARY="$LOGS/summary.txt"
: > "$SUMMARY"
FAILED=0

step() {  # step NAME SECONDS COMMAND...: run it, log it, note its status and time
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name: $*"
    start=$(date +%s)
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    printf '%-22s %s (%s s)\n' "$name" "$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc")" \
        "$(( $(date +%s) - start ))" | tee -a "$SUMMARY"
    [ $rc -eq 0 ] || FAILED=1
}

{
    echo "gpu_check $(date -u +%FT%TZ) on $(hostname)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    "$PY" -c "import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, \
'nccl', nccl.get_version())" 2>&1
    git rev-parse --short HEAD 2>/dev/null
} > "$LOGS/environment.txt"

step 1-tests-gpu 120 "$PY" -m pytest -q -p no:cacheprovider tests/gpu
if [ -n "$MPIEXEC" ]; then
    step 2-mpi-cupy-2-ranks 120 "$MPIEXEC" -n 2 "$PY" -m mpi4py tests/world/test_mpi_launch.py \
        pytest tests/gpu/test_cupy_collectives.py tests/gpu/test_cupy_wrappers.py
    step 3-bench-gpu 120 "$MPIEXEC" -n 2 "$PY" benchmarks/bench_gpu.py --quick \
        --json "$LOGS/bench_gpu.json"
else
    echo "no mpiexec: steps 2 and 3 skipped" | tee -a "$SUMMARY"
fi
if "$PY" -c "import torch" >/dev/null 2>&1; then
    step 4-torch-side-by-side 80 "$PY" benchmarks/torch_gpu.py --quick
else
    echo "torch is not importable: step 4 skipped" | tee -a "$SUMMARY"
fi
step 5-char-lm-gpu 120 "$PY" examples/char_lm.py --device gpu --world-size 1 --steps 8
step 5-char-lm-cpu 60 "$PY" examples/char_lm.py --device cpu --world-size 1 --steps 8
step 5-digits-gpu 45 "$PY" examples/digits_ddp_fsdp.py --device gpu --world-size 1 --epochs 5
if [ -n "$MPIEXEC" ]; then
    step 5-digits-gpu-mpi 45 "$MPIEXEC" -n 2 "$PY" examples/digits_ddp_fsdp.py --device gpu \
        --epochs 5
fi

# The char LM's step time: the single-process row ("1 process ... ms/step device").
ms() { awk '$1 == "1" && $2 == "process" { print $(NF - 1) }' "$LOGS/$1.log" 2>/dev/null; }
echo "char LM step time (1 process, ms): gpu $(ms 5-char-lm-gpu), numpy $(ms 5-char-lm-cpu)" \
    | tee -a "$SUMMARY"
echo "logs in $LOGS"
exit $FAILED
