#!/usr/bin/env bash
# Qwen3.5 / Qwen3-Next hybrid trees on real Gated DeltaNet kernels, one unattended H200 call: every kernel route of
# benchmarks/gdn_kernels.py is installed in its own target folder, checked on one K = 128 forward + backward against
# transformers' torch reference (benchmarks/gdn_kernel_check.py), and the first route that passes (FlashQLA, then
# fla + TileLang, then fla's Triton kernels, then fla 0.4.2) gets the parity tests and the benchmark rows. Every step
# has its own time limit and the whole run a budget (BUDGET seconds, default 540): what does not fit is skipped and
# said so; nothing waits on a hung step.
#
# Packages and caches: benchmarks/hybrid_env.sh (carry .whl/hybrid).
#
#   bash benchmarks/gpu_hybrid_kernels.sh          results in $OUT (at most 8 files; see the end of this script)
set -uo pipefail
START=$SECONDS
BUDGET=${BUDGET:-540}
OUT=${OUT:-/tmp/hybrid_out}
W=/tmp/hyb
mkdir -p "$OUT" "$W"
exec > >(tee "$W/main.log") 2>&1

left() { echo $((BUDGET - (SECONDS - START))); }
# step NAME MAX_S LOG CMD...: CMD (output to LOG, its last lines shown) under a limit of min(MAX_S, time left - 15 s);
# skipped below 30 s.
step() {
  local name=$1 max=$2 log=$3 t t0=$SECONDS rc
  shift 3
  t=$(($(left) - 15))
  ((t > max)) && t=$max
  if ((t < 30)); then
    note "$name: skipped, out of time ($(left) s left)"
    return 124
  fi
  echo "=== $name (limit ${t} s, $(left) s left)"
  timeout -k 5 "$t" "$@" >"$log" 2>&1
  rc=$?
  grep -v -i -E "warn|^\[transformers\]" "$log" | tail -8 | cut -c1-400
  note "$name: rc=$rc in $((SECONDS - t0)) s$( ((rc == 124)) && echo ' (time limit)')"
  return $rc
}

source benchmarks/hybrid_env.sh
# Preference order for the benchmark rows; ROUTES="flash_qla fla_tilelang" runs only those.
read -r -a LABELS <<<"${ROUTES:-flash_qla fla_tilelang fla_triton fla042}"
# ---- 1. per-route kernel checks, all at once (compilation is CPU work; the GPU work is small). As soon as a route's
# check passes, its parity tests start beside the others (nothing here is timed); the benchmark rows go to the first
# route, in the order of LABELS, whose check passes.
CHECK_MAX=${CHECK_MAX:-240}
PARITY_MAX=${PARITY_MAX:-200}
declare -A PID RC TPID TRC
per_test=
python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout 200"
parity_cmd() {  # the route's GPU tests (tests/test_gpu_recurrent.py); base = the torch kernels, without fla
  local k="${ROUTE[$1]:-} or uses_the_varlen"
  [ -n "${PARITY_K:-}" ] && k="${ROUTE[$1]:-} and ($PARITY_K)"  # e.g. PARITY_K="qwen3_5_k128 and bf16"
  [ "$1" = base ] && k="torch or hybrid_tree_matches"
  # -s: each test prints what it measured as it goes; shellcheck disable=SC2086
  echo env PYTHONPATH="$(pypath "$1")" python3 -m pytest -v -s -rfEs -m gpu -p no:cacheprovider $per_test \
    tests/test_gpu_recurrent.py -k "'$k'"
}
parity_summary() {
  grep -E "PASSED|FAILED|ERROR|SKIPPED|kernels |gradient cosine|passed|failed|^E |Error" "$W/pytest_$1.log" \
    | grep -v -i warn | cut -c1-300 | tail -60
}
for label in "${LABELS[@]}"; do  # env execs timeout: $! is timeout's pid, which passes a TERM on to the check
  if [ "${CHECKS:-1}" = 0 ]; then  # the checks ran before (kernel_checks.json): straight to the parity tests
    true &
  else
    env PYTHONPATH="$(pypath "$label")" timeout -k 5 "$CHECK_MAX" python3 benchmarks/gdn_kernel_check.py \
      --route "${ROUTE[$label]}" --label "$label" --out "$W/check_$label.json" >"$W/check_$label.log" 2>&1 &
  fi
  PID[$label]=$!
done
collect() {  # collect LABEL: record a finished check (RC 0 = gate passed, 1 = failed, 2 = unavailable, 124 = time
  # limit, 143 = stopped) and start the route's parity tests when it passed; record finished parity runs
  local label=$1
  if [ -z "${RC[$label]:-}" ] && ! kill -0 "${PID[$label]}" 2>/dev/null; then
    wait "${PID[$label]}"
    RC[$label]=$?
    note "check $label: rc=${RC[$label]} at $((SECONDS - START)) s"
    grep '^{' "$W/check_$label.log" | cut -c1-600
    ((RC[$label] > 2)) && tail -5 "$W/check_$label.log"
    if [ "${RC[$label]}" = 0 ] && [ -n "$LAUNCH" ]; then
      bash -c "exec timeout -k 5 $PARITY_MAX $(parity_cmd "$label")" >"$W/pytest_$label.log" 2>&1 &
      TPID[$label]=$!  # bash execs timeout: the same pid
      note "parity $label: started at $((SECONDS - START)) s"
    fi
  fi
  if [ -n "${TPID[$label]:-}" ] && [ -z "${TRC[$label]:-}" ] && ! kill -0 "${TPID[$label]}" 2>/dev/null; then
    wait "${TPID[$label]}"
    TRC[$label]=$?
    note "parity $label: rc=${TRC[$label]} at $((SECONDS - START)) s"
    parity_summary "$label"
  fi
}
LAUNCH=yes
BEST=
decided=
while [ -z "$decided" ]; do
  for label in "${LABELS[@]}"; do collect "$label"; done
  decided=yes
  for label in "${LABELS[@]}"; do
    if [ -z "${RC[$label]:-}" ]; then decided=; break; fi
    if [ "${RC[$label]}" = 0 ]; then BEST=$label; break; fi
  done
  [ -z "$decided" ] && sleep 2
done
if [ "${CHECKS:-1}" = 0 ] && [ -n "$BEST" ]; then  # no checks: the first route whose parity tests pass
  while :; do
    running=
    for label in "${LABELS[@]}"; do collect "$label"; [ -z "${TRC[$label]:-}" ] && running=yes; done
    [ -z "$running" ] && break
    sleep 2
  done
  for label in "${LABELS[@]}"; do
    if [ "${TRC[$label]}" = 0 ]; then BEST=$label; break; fi
  done
fi
note "route for the benchmark rows: ${BEST:-none}"
end_pid() {  # end_pid PID: TERM to a `timeout` this script started (it passes it on), KILL to both after 10 s
  kill -TERM "$1" 2>/dev/null
  for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
  pkill -KILL -P "$1" 2>/dev/null
  kill -KILL "$1" 2>/dev/null
}
stop() {  # stop LABEL: end its check / parity run if still running (the benchmarks want the GPU and CPUs alone)
  if [ -z "${RC[$1]:-}" ]; then end_pid "${PID[$1]}"; fi
  if [ -n "${TPID[$1]:-}" ] && [ -z "${TRC[$1]:-}" ]; then end_pid "${TPID[$1]}"; fi
  collect "$1"
}
parity() {  # parity LABEL MAX_S, in the foreground
  step "parity $1" "$2" "$W/pytest_$1.log" bash -c "$(parity_cmd "$1")"
  parity_summary "$1"
}
bench() {  # bench LABEL NAME MAX_S ARGS...: bench_tree_vs_flat.py on the route's kernels
  local label=$1 name=$2 max=$3
  shift 3
  step "$name" "$max" "$W/bench_${name//[^A-Za-z0-9.]/_}.log" env PYTHONPATH="$(pypath "$label")" python3 \
    benchmarks/bench_tree_vs_flat.py "$@" --gdn-route "${ROUTE[$label]}"
}

if [ -n "$BEST" ]; then
  # ---- 2. the chosen route's parity tests, to their end (its time limit)
  while [ -z "${TRC[$BEST]:-}" ]; do collect "$BEST"; sleep 2; done
  # ---- 3. benchmark rows on the chosen route, alone on the machine
  LAUNCH=
  for label in "${LABELS[@]}"; do stop "$label"; done
  R=$BEST
  bench $R "0.8B GRPO [$R]" "${BENCH_MAX:-150}" --models qwen3.5-0.8b --workloads grpo_G16_P4096_C512 --scale 0.25 \
    --repeats 1 \
    --out "$OUT/tree_vs_flat_h200_qwen3.5-0.8b_$R.json"
  bench $R "0.8B agent 20 turns [$R]" 200 --models qwen3.5-0.8b --workloads agent_20_turns --scale 0.25 \
    --repeats 1 --out "$OUT/tree_vs_flat_h200_qwen3.5-0.8b_agent20_$R.json"
  step "levels [$R]" 90 "$W/bench_levels_$R.log" env PYTHONPATH="$(pypath $R)" python3 benchmarks/bench_levels.py \
    --device cuda --heads 16 --dim 128 --scale 1 --gdn-route "${ROUTE[$R]}" --out "$OUT/levels_h200_$R.json"
  bench $R "2B GRPO [$R]" 150 --models qwen3.5-2b --workloads grpo_G16_P4096_C512 --scale 0.25 --repeats 1 \
    --out "$OUT/tree_vs_flat_h200_qwen3.5-2b_$R.json"
fi
# ---- 4. with the time left: the parity runs stopped or not yet run, a second route's 0.8B row, the torch kernels'
for label in "${LABELS[@]}"; do
  if [ "${RC[$label]:-}" = 0 ] && [ "${TRC[$label]:-143}" -gt 123 ]; then parity "$label" 150; fi
done
for label in "${LABELS[@]}"; do
  if [ "${RC[$label]:-}" = 0 ] && [ "$label" != "$BEST" ]; then
    bench "$label" "0.8B GRPO [$label]" 150 --models qwen3.5-0.8b --workloads grpo_G16_P4096_C512 --scale 0.25 \
      --repeats 1 --out "$OUT/tree_vs_flat_h200_qwen3.5-0.8b_$label.json"
    break
  fi
done
parity base 150

# ---- results: kernel_checks.json (every check + the step list), gpu_tests_hybrid_kernels.log (every pytest run),
# hybrid_gpu.log (this log, then every check's), and the benchmark JSONs written above (at most 5)
python3 - "$W" "$OUT" <<'EOF'
import glob, json, os, sys
w, out = sys.argv[1:]
checks = {os.path.basename(p)[len("check_"):-len(".json")]: json.load(open(p)) for p in sorted(glob.glob(f"{w}/check_*.json"))}
steps = open(f"{w}/status").read().splitlines() if os.path.exists(f"{w}/status") else []
json.dump({"steps": steps, "checks": checks}, open(f"{out}/kernel_checks.json", "w"), indent=1)
for label, run in checks.items():
    for case in run["cases"]:
        print(f"{label:<13} K={case['K']:<3} {case['dtype']} lifted={case['guard_lifted']!s:<5} {case['status']:<11}"
              f" worst rms {case.get('worst_rms_ratio', float('nan')):.2e} first {case.get('first_call_s', 0):.0f}s "
              f"| {case.get('kernels') or case.get('reason') or case.get('error', '')[:150]}")
EOF
for f in "$W"/pytest_*.log; do [ -f "$f" ] && { echo "##### $f"; cat "$f"; }; done >"$OUT/gpu_tests_hybrid_kernels.log"
sleep 1
{
  cat "$W/main.log"
  for f in "$W"/check_*.log "$W"/bench_*.log; do [ -f "$f" ] && { echo "##### $f"; cat "$f"; }; done
} >"$OUT/hybrid_gpu.log"
echo "=== done in $((SECONDS - START)) s; $(ls "$OUT" | wc -l) files in $OUT"
cat "$W/status"
