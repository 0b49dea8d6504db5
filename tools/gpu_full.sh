#!/usr/bin/env bash
# A milestone's GPU run in stages, each under its own time limit, logs under $OUT/logs (packed into
# $OUT/logs.tgz after every stage, so a run cut short still brings back what it did):
#   tools/gpu_full.sh STAGE...     stages: fuzzpre tests huge fuzz sanitize(=runs in the background until
#                                   `wait`) wait bench host multigpu (the machine with 2 GPUs) pytest (PYTEST_ARGS)
#   env: N (pytest workers, 8), FUZZ_EXAMPLES (24), BENCHES ("bench_norm bench_index_add bench_prelu"), BENCH_ARGS,
#        T_<stage> (seconds; defaults below)
# Needs .whl (nvidia-cutlass) and a kernel cache in .cache/igemm (tools/precompile_all.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; L=$OUT/logs; mkdir -p "$L"
export PYTHONUNBUFFERED=1 IGEMM_CACHE_DIR=${IGEMM_CACHE_DIR:-$PWD/.cache/igemm}
OUT=$L tools/gpu_check.sh > "$L/setup.log" 2>&1 || { cat "$L/setup.log"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD
N=${N:-8}
pack() { tar -czf "$OUT/logs.tgz" -C "$OUT" logs 2>/dev/null; }
stage() {   # stage NAME SECONDS CMD...
  local name=$1 secs=$2 t0 rc; shift 2
  t0=$(date +%s)
  timeout -k 10 "$secs" "$@" > "$L/$name.log" 2>&1; rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s (limit $secs)"
  grep -E "(passed|failed|error)s? in |xfailed|XPASS|^FAILED|^ERROR" "$L/$name.log" | tail -25
  pack
}
SAN_PID=
for s in "$@"; do
  case $s in
    fuzzpre) stage fuzzpre "${T_fuzzpre:-240}" python3 tests/test_fuzz.py precompile sm_90a ;;
    tests) stage tests "${T_tests:-300}" python3 -m pytest tests -m "gpu and not slow and not multigpu" -q -n "$N" \
             -rfEx --tb=short -p no:cacheprovider ;;
    huge) stage huge "${T_huge:-240}" python3 -m pytest tests/test_huge.py -q -rfEs --tb=short -p no:cacheprovider ;;
    fuzz) rm -f "$L/fuzz-count.txt"
          IGEMM_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-24} IGEMM_FUZZ_LOG=$L/fuzz-count.txt \
            stage fuzz "${T_fuzz:-420}" python3 -m pytest tests/test_fuzz.py -m "gpu" -q -n "$N" -rfE --tb=short \
            -p no:cacheprovider
          echo "fuzz problems run: $(awk '{s += $2} END {print s + 0}' "$L/fuzz-count.txt" 2>/dev/null)" ;;
    sanitize) ( OUT=$L/sanitize JOBS=${SAN_JOBS:-4} timeout -k 10 "${T_sanitize:-540}" tools/sanitize.sh \
                  > "$L/sanitize.log" 2>&1; echo "rc=$?" >> "$L/sanitize.log" ) &
              SAN_PID=$! ;;
    wait) [ -n "$SAN_PID" ] && wait "$SAN_PID"; echo "== sanitize:"; tail -32 "$L/sanitize.log"; pack ;;
    bench) for b in ${BENCHES:-bench_norm bench_index_add bench_prelu}; do
             stage "$b" "${T_bench:-240}" python3 "benchmarks/$b.py" --out "$L" ${BENCH_ARGS:-}
             tail -45 "$L/$b.log" | grep -E "^\|" | head -45
           done ;;
    pytest) stage pytest "${T_pytest:-300}" bash -c "python3 -m pytest ${PYTEST_ARGS:-tests} -q -rfEx --tb=short -p no:cacheprovider" ;;
    host) stage host_overhead 120 python3 benchmarks/host_overhead.py --out "$L"; cat "$L/host_overhead.log" ;;
    multigpu) # the two-GPU SyncBN test, and the validation rows that need a second GPU
              stage multigpu-validation 120 python3 -m pytest tests/test_validation.py -q -rfEs --tb=short \
                -p no:cacheprovider -k "two-devices or other-device or plan-other-device or current_device_kept"
              NCCL_NVLS_ENABLE=0 stage multigpu "${T_multigpu:-420}" python3 -m pytest tests/test_syncbn.py \
                -m multigpu -q -rfEx --tb=short -p no:cacheprovider --basetemp="$L/syncbn-tmp"
              tail -40 "$L/multigpu.log" ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
pack
