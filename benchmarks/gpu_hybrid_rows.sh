#!/usr/bin/env bash
# Qwen3.5 hybrid benchmark rows on one Gated DeltaNet kernel route, in two H200 calls made back to back (a warm
# machine keeps /tmp, and with it the installed packages and every compiled kernel and autotuning result):
#
#   PHASE=warm bash benchmarks/gpu_hybrid_rows.sh    the route's parity tests (tests/test_gpu_recurrent.py, one
#       process per test) and one untimed run of each benchmark below, all at once: Triton compiles and autotunes
#       on the CPUs, each process for the kernel variants it meets first, and every process finds on disk what the
#       others finished. The parity tests' results count; the benchmarks' timings are not rows (compilation ran
#       inside them, beside the others).
#   PHASE=rows bash benchmarks/gpu_hybrid_rows.sh    the rows, one after another, alone on the machine.
#
# One route (ROUTE, default fla_tilelang: fla 0.6's Triton kernels with the gated dqkwg backward on TileLang, which
# fla picks by default on Hopper with Triton >= 3.4 once tilelang imports). A one-call warm-up does not fit: the first
# process on a machine spends minutes compiling each kernel's autotuning configs, one after another (the reason the
# rows of gpu_hybrid_kernels.sh ran out of time). Side by side the warm phase's processes can exhaust the GPU's memory
# or crash (seen once each: an out-of-memory error, a segfault in a benchmark's backward); whatever they compiled
# before stays on disk. Packages and caches: benchmarks/hybrid_env.sh (carry .whl/hybrid).
# ONLY="levels qwen3.5-2b_grpo" runs those benchmarks alone; PARITY_K="tree_matches" selects parity tests (pytest -k,
# within the route's). Results under $OUT: hybrid_<phase>.tgz (every log and JSON of the phase), triton_autotune.tgz
# (Triton's autotuning results, for a later machine's TRITON_CACHE_DIR), and the phase's status lines on stdout.
set -uo pipefail
START=$SECONDS
PHASE=${PHASE:?PHASE=warm or PHASE=rows}
BUDGET=${BUDGET:-540}
LABEL=${ROUTE:-fla_tilelang}
OUT=${OUT:-/tmp/hybrid_out}
W=/tmp/hyb
R=$W/$PHASE
mkdir -p "$OUT" "$R"
source benchmarks/hybrid_env.sh
export PYTHONPATH
PYTHONPATH=$(pypath "$LABEL")
left() { echo $((BUDGET - (SECONDS - START))); }
finish() {
  note "$PHASE done at $((SECONDS - START)) s"
  cp "$W/status" "$R/status.txt"
  find "$TRITON_CACHE_DIR" -name "*.autotune.json" 2>/dev/null | wc -l | xargs echo "autotuning results on disk:" \
    | tee -a "$R/status.txt"
  tar czf "$OUT/hybrid_$PHASE.tgz" -C "$W" "$PHASE"
  (cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" -print0 | tar czf "$OUT/triton_autotune.tgz" --null -T -)
  ls -la "$OUT"
}

# The benchmarks: NAME SCRIPT ARGS... (each writes $R/NAME_<route>.json). The route written in them is the default;
# ROUTE=... replaces it.
BENCHES=(
  "qwen3.5-0.8b_grpo benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --workloads grpo_G16_P4096_C512 \
    --scale 0.25 --repeats 1 --gdn-route fla_tilelang"
  "qwen3.5-0.8b_agent20 benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --workloads agent_20_turns \
    --scale 0.25 --repeats 1 --gdn-route fla_tilelang"
  "levels benchmarks/bench_levels.py --device cuda --heads 16 --dim 128 --scale 1 --gdn-route fla_tilelang"
  "qwen3.5-2b_grpo benchmarks/bench_tree_vs_flat.py --models qwen3.5-2b --workloads grpo_G16_P4096_C512 \
    --scale 0.25 --repeats 1 --gdn-route fla_tilelang"
)
bench_cmd() {  # bench_cmd NAME SCRIPT ARGS...: the benchmark's command line on $LABEL's route
  local name=$1
  shift
  echo python3 "${@/#fla_tilelang/${ROUTE[$LABEL]}}" --out "$R/${name}_$LABEL.json"
}
if [ -n "${ONLY:-}" ]; then
  mapfile -t BENCHES < <(for spec in "${BENCHES[@]}"; do [[ " $ONLY " == *" ${spec%% *} "* ]] && echo "$spec"; done)
fi

if [ "$PHASE" = warm ]; then
  # Where each process spends its time: every autotuning (Triton prints the config it picked and how long it took)
  # and, every 60 s, every thread's Python stack (faulthandler, through a sitecustomize on the path).
  mkdir -p "$W/diag"
  cat >"$W/diag/sitecustomize.py" <<'PY'
import faulthandler, os
if os.environ.get("HYB_STACKS"):
    faulthandler.dump_traceback_later(60, repeat=True, file=open(f"{os.environ['HYB_STACKS']}.{os.getpid()}", "w"))
PY
  export TRITON_PRINT_AUTOTUNING=1
  autotunings() {  # how many autotunings a log shows and their seconds ("finished after 12.34s," per autotuning)
    grep -o "finished after [0-9.]*s" "$@" | tr -d s | awk '{n++; t+=$3} END {printf "%d autotunings, %.0f s", n, t}'
  }
  WARM_MAX=$(($(left) - 20))
  pids=()
  launch() {  # launch NAME CMD...: in the background, niced (a job beside this one keeps its CPUs), logged to $R
    local name=$1
    shift
    HYB_STACKS=$R/stacks_$name PYTHONPATH=$W/diag:$PYTHONPATH nice -n 10 timeout -k 5 "$WARM_MAX" "$@" \
      >"$R/$name.log" 2>&1 &
    pids+=($!)
  }
  mapfile -t tests < <(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/test_gpu_recurrent.py \
    -k "(${ROUTE[$LABEL]} or uses_the_varlen)${PARITY_K:+ and ($PARITY_K)}" 2>/dev/null | grep "::")
  note "warm: ${#tests[@]} parity tests and ${#BENCHES[@]} benchmarks at once, limit $WARM_MAX s"
  for i in "${!tests[@]}"; do
    launch "parity_$i" python3 -m pytest -v -s -rfEs -m gpu -p no:cacheprovider "${tests[$i]}"
  done
  for spec in "${BENCHES[@]}"; do
    read -r -a args <<<"$spec"
    # the 2B model's Gated DeltaNet layers have the 0.8B's heads: the 0.8B GRPO run warms its kernels
    [[ ${args[0]} == qwen3.5-2b_grpo && " ${BENCHES[*]} " == *" qwen3.5-0.8b_grpo "* ]] && continue
    # shellcheck disable=SC2046
    launch "${args[0]}" $(bench_cmd "${args[@]}")
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  for i in "${!tests[@]}"; do
    result=$(grep -E "^=+ .*(passed|failed|error|skipped).* in [0-9.]+s" "$R/parity_$i.log" | tail -1 | tr -d =)
    note "${tests[$i]#tests/test_gpu_recurrent.py::}: ${result:-no result (time limit?)}"
    grep -E "^E " "$R/parity_$i.log" | head -5 | cut -c1-300
  done
  for spec in "${BENCHES[@]}"; do
    name=${spec%% *}
    [ -f "$R/$name.log" ] && note "warm $name: $(autotunings "$R/$name.log");" \
      "$(grep -v -i -E "warn|^\[transformers\]|autotuning|with key|finished after|best config" "$R/$name.log" \
        | tail -2 | cut -c1-300)"
  done
  note "parity processes: $(cat "$R"/parity_*.log | autotunings)"
else
  for spec in "${BENCHES[@]}"; do
    read -r -a args <<<"$spec"
    t=$(($(left) - 15))
    if ((t < 30)); then note "${args[0]}: skipped, out of time"; continue; fi
    t0=$SECONDS
    # shellcheck disable=SC2046
    timeout -k 5 "$t" $(bench_cmd "${args[@]}") >"$R/${args[0]}.log" 2>&1
    rc=$?
    note "${args[0]}: rc=$rc in $((SECONDS - t0)) s$( ((rc == 124)) && echo ' (time limit)')"
    grep -v -i -E "warn|^\[transformers\]" "$R/${args[0]}.log" | tail -4 | cut -c1-400
  done
fi
finish
