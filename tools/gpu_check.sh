#!/usr/bin/env bash
# A milestone's GPU run in stages, each under its own time limit, on a machine without network (the carried
# wheels are installed first). Logs go to $OUT/logs and are packed into $OUT/logs.tgz after every stage, so a run
# cut short still brings back what it did.
#
#   tools/gpu_check.sh STAGE...
#     tests      the GPU suite: pytest -m "gpu and not slow and not multigpu" (N workers)
#     fuzz       the hypothesis fuzz on the GPU ($FUZZ_EXAMPLES examples per item; prints the problem count), then
#                $GRAD_PROBLEMS (300) random backward problems per op x dtype x layout
#     bgfuzz     the fuzz in the background (with $FUZZ_N workers) until `wait`
#     sanitize   tools/sanitize.sh, every family, in the background until `wait`
#     wait       wait for the background stages; print the sanitizer's table and the fuzz count
#     bench      the benchmarks in $BENCHES (default: bench_conv bench_epilogues) with $BENCH_ARGS
#     host       benchmarks/host_overhead.py, and the same benchmark of the checkout in $OLD if set
#     multigpu   the two-GPU tests (SyncBN, device-mismatch rows)
#     pytest     pytest $PYTEST_ARGS
#   env: N (pytest workers, 12), FUZZ_EXAMPLES (24), T_<stage> (seconds), OUT (/tmp/out), OLD (another checkout)
#
# Carry .whl (../shared/device/fetch-wheels.sh: nvidia-cutlass) and, to spare the GPU machine the compiles,
# .cache.tar.xz: a kernel cache made on the dev machine (tools/precompile_all.sh, then
# `tar -cJf .cache.tar.xz -C .cache igemm`), unpacked into .cache/igemm here.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; L=$OUT/logs; mkdir -p "$L"
export PYTHONUNBUFFERED=1 IGEMM_CACHE_DIR=${IGEMM_CACHE_DIR:-$PWD/.cache/igemm} NCCL_NVLS_ENABLE=0
mkdir -p "$IGEMM_CACHE_DIR"
if ! python3 -c "import cutlass_library" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 3; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -f .cache.tar.xz ] && [ -z "$(ls -A "$IGEMM_CACHE_DIR")" ] && tar -xJf .cache.tar.xz -C "$(dirname "$IGEMM_CACHE_DIR")"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, cuda.core, numpy; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version(),
'cuda.core', cuda.core.__version__, 'numpy', numpy.__version__)"
  python3 -m igemm info
  echo "kernel cache: $(ls "$IGEMM_CACHE_DIR" | grep -c cubin) cubins"
} 2>&1 | tee "$L/device.txt"
N=${N:-12}
pack() { tar -czf "$OUT/logs.tgz" -C "$OUT" logs 2>/dev/null; }
stage() {   # stage NAME SECONDS CMD...
  local name=$1 secs=$2 t0 rc; shift 2
  t0=$(date +%s)
  timeout -k 10 "$secs" "$@" > "$L/$name.log" 2>&1; rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s (limit $secs)"
  grep -E "(passed|failed|error)s? in |xfailed|XPASS|^FAILED|^ERROR" "$L/$name.log" | tail -25
  pack
}
fuzz() {   # the GPU fuzz with $1 workers
  rm -f "$L/fuzz-count.txt"
  export IGEMM_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-24} IGEMM_FUZZ_LOG=$L/fuzz-count.txt
  stage fuzz "${T_fuzz:-420}" python3 -m pytest tests/test_fuzz.py -m "gpu" -q -n "$1" -rfE --tb=short \
    -p no:cacheprovider
  echo "fuzz problems run: $(awk '{s += $2} END {print s + 0}' "$L/fuzz-count.txt" 2>/dev/null)"
  # the convolution backward: $GRAD_PROBLEMS random problems per op x dtype x layout (12 items)
  IGEMM_GRAD_PROBLEMS=${GRAD_PROBLEMS:-300} stage fuzz-backward "${T_fuzz:-420}" python3 -m pytest \
    tests/test_backward.py -k random_problems -m gpu -q -n "$1" -rfE --tb=short -p no:cacheprovider
  local items; items=$(grep -oE "[0-9]+ passed" "$L/fuzz-backward.log" 2>/dev/null | grep -oE "[0-9]+")
  echo "backward problems run: $(( ${items:-0} * ${GRAD_PROBLEMS:-300} )) (passed items x problems an item)"
}
BG=()
for s in "$@"; do
  case $s in
    tests) stage tests "${T_tests:-420}" python3 -m pytest tests -m "gpu and not slow and not multigpu" -q -n "$N" \
             -rfEx --tb=short -p no:cacheprovider ;;   # (the fuzz's GPU items are `slow`: the fuzz stage runs them)
    fuzz) fuzz "$N" ;;
    bgfuzz) fuzz "${FUZZ_N:-4}" > "$L/fuzz-summary.txt" 2>&1 &
            BG+=($!) ;;
    sanitize) ( OUT=$L/sanitize JOBS=${SAN_JOBS:-4} timeout -k 10 "${T_sanitize:-540}" tools/sanitize.sh \
                  > "$L/sanitize.log" 2>&1; echo "rc=$?" >> "$L/sanitize.log" ) &
              BG+=($!) ;;
    wait) [ ${#BG[@]} -gt 0 ] && wait "${BG[@]}"; BG=()
          [ -f "$L/fuzz-summary.txt" ] && cat "$L/fuzz-summary.txt"
          [ -f "$L/sanitize.log" ] && { echo "== sanitize:"; tail -32 "$L/sanitize.log"; }
          pack ;;
    bench) for b in ${BENCHES:-bench_conv bench_epilogues}; do
             stage "$b" "${T_bench:-240}" python3 "benchmarks/$b.py" --out "$L" ${BENCH_ARGS:-}
             grep -E "^\|" "$L/$b.log" | head -45
           done ;;
    host) stage host "${T_host:-120}" python3 benchmarks/host_overhead.py --out "$L"
          grep -E "^\||launch step" "$L/host.log"
          if [ -n "${OLD:-}" ]; then          # the same benchmark, the other checkout's code, the same machine
            stage host-old "${T_host:-120}" env PYTHONPATH="$OLD:/tmp/site" IGEMM_CACHE_DIR="$IGEMM_CACHE_DIR-old" \
              python3 "$OLD/benchmarks/host_overhead.py" --out "$L/old"
            grep -E "^\||launch step" "$L/host-old.log"
          fi ;;
    pytest) stage pytest "${T_pytest:-300}" bash -c "python3 -m pytest ${PYTEST_ARGS:-tests} -q -rfEx --tb=short -p no:cacheprovider" ;;
    multigpu) stage multigpu "${T_multigpu:-420}" python3 -m pytest tests -m multigpu -q -rfEs --tb=short \
                -p no:cacheprovider ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
pack
