#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over a small case of every kernel family and
# config kind (tools/sanitize_cases.py): a PASS/FAIL table per (tool, family); exit status 1 on any failure.
#
#   tools/sanitize.sh [family ...]          families: conv relu norm syncbn index_add prelu compare backward pool
#                                           (default: all)
#   env: TOOLS="memcheck racecheck initcheck synccheck"  JOBS=4 (sanitizer runs at once)  OUT=/tmp/sanitize (logs)
#        LINEINFO=1 (compile with -lineinfo: sanitizer reports name source lines; a separate kernel cache key)
#
# First every family runs once without a sanitizer (compiles its kernels into $IGEMM_CACHE_DIR and checks the
# answers), then each (tool, family) pair runs under compute-sanitizer with --error-exitcode 1. A pair passes
# when the sanitizer reports no error and every case's result is right. torch's caching allocator is off
# (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so each tensor is its own allocation: memcheck sees exact bounds and
# initcheck sees fresh (uninitialised) outputs the kernels must write in full.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
FAMILIES=${*:-conv relu norm syncbn index_add prelu compare backward pool}
TOOLS=${TOOLS:-memcheck racecheck initcheck synccheck}
JOBS=${JOBS:-4}
OUT=${OUT:-/tmp/sanitize}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1
export IGEMM_CACHE_DIR=${IGEMM_CACHE_DIR:-$ROOT/.cache/igemm}
[ "${LINEINFO:-0}" != "0" ] && export IGEMM_DEBUG=1
mkdir -p "$IGEMM_CACHE_DIR"

if ! python3 -c "import cutlass_library" 2>/dev/null; then          # the GPU machine: wheels carried in .whl
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "wheel install failed"; exit 3; }
    export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
[ -n "$SAN" ] || { echo "compute-sanitizer not found"; exit 2; }
echo "compute-sanitizer: $SAN ($("$SAN" --version | tail -1))"
echo "families: $FAMILIES"; echo "tools: $TOOLS"; echo "logs: $OUT"

# 1. warm the kernel cache and check the answers, all families at once (nvcc runs in parallel)
declare -A WARM
for f in $FAMILIES; do
  ( python3 tools/sanitize_cases.py "$f" > "$OUT/warm-$f.log" 2>&1; echo $? > "$OUT/warm-$f.rc" ) &
done
wait
for f in $FAMILIES; do
  WARM[$f]=$(cat "$OUT/warm-$f.rc")
  [ "${WARM[$f]}" = 0 ] || { echo "== $f fails without a sanitizer:"; tail -30 "$OUT/warm-$f.log"; }
done

# 2. the sanitizer runs, JOBS at a time
run_one() {
  local tool=$1 fam=$2 extra=() t0 rc
  case $tool in
    memcheck) extra=(--check-api-memory-access yes --leak-check no) ;;
    racecheck) extra=(--racecheck-report all) ;;
  esac
  t0=$(date +%s)
  "$SAN" --tool "$tool" --error-exitcode 1 --print-limit 100 ${extra[@]+"${extra[@]}"} \
    python3 tools/sanitize_cases.py "$fam" > "$OUT/$tool-$fam.log" 2>&1
  rc=$?
  echo "$rc $(( $(date +%s) - t0 ))" > "$OUT/$tool-$fam.rc"
}
export -f run_one
export SAN OUT
for t in $TOOLS; do for f in $FAMILIES; do echo "$t $f"; done; done | xargs -P "$JOBS" -n 2 bash -c 'run_one "$0" "$1"'

# 3. the table
fail=0
printf '\n%-10s %-10s %-6s %-8s %-44s %s\n' tool family result seconds sanitizer cases
for t in $TOOLS; do
  for f in $FAMILIES; do
    log=$OUT/$t-$f.log
    read -r rc secs < "$OUT/$t-$f.rc" 2>/dev/null || { rc=99; secs=-; }
    san=$(grep -Eo '(ERROR SUMMARY: [0-9]+ errors?|RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ errors?, [0-9]+ warnings?\))' "$log" | tail -1)
    errs=$(echo "$san" | grep -Eo '[0-9]+ errors?' | grep -Eo '[0-9]+' | head -1)
    # memcheck also reports failed host API calls; cuda.bindings probes the driver's entry points with
    # cuGetProcAddress when it loads (some do not exist in this driver): those probes are not errors of ours
    probes=$(grep -c 'on CUDA API call to cuGetProcAddress' "$log")
    other=$(( ${errs:-0} - probes ))
    if grep -q "sanitize_cases: all ok" "$log"; then cases=ok; else cases=FAILED; fi
    if [ "$other" = 0 ] && { [ "$rc" = 0 ] || { [ "$rc" = 1 ] && [ "$probes" -gt 0 ]; }; } && [ "$cases" = ok ] && [ "${WARM[$f]}" = 0 ]; then
      res=PASS; else res=FAIL; fail=1; fi
    [ "$probes" -gt 0 ] && san="$san ($probes cuGetProcAddress probes)"
    printf '%-10s %-10s %-6s %-8s %-44s %s\n' "$t" "$f" "$res" "$secs" "${san:-no summary}" "$cases"
  done
done
if [ $fail != 0 ]; then
  echo; echo "failures (first sanitizer reports):"
  for t in $TOOLS; do for f in $FAMILIES; do
    log=$OUT/$t-$f.log
    if ! grep -q "sanitize_cases: all ok" "$log" || grep -Eq '(ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: .*\([1-9][0-9]* error)' "$log"; then
      echo "== $t $f ($log)"; grep -E '^========= ' "$log" | grep -vE 'SUMMARY|COMPUTE-SANITIZER|Host Frame|cuGetProcAddress|Saved host backtrace' | head -20
      grep -E '^FAIL ' "$log" | head -5
    fi
  done; done
fi
exit $fail
