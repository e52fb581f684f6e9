#!/usr/bin/env bash
# Qwen3.5 hybrid benchmark rows on Gated DeltaNet kernel routes, in two H200 calls made back to back (a warm machine
# keeps /tmp, and with it the installed packages and every compiled kernel and autotuning result):
#
#   PHASE=warm bash benchmarks/gpu_hybrid_rows.sh    the routes' parity tests (tests/test_gpu_recurrent.py, one
#       process per test), the kernel checks asked for (CHECKS) and one untimed run of each benchmark job, all at
#       once: Triton compiles and autotunes on the CPUs, each process for the kernel variants it meets first, and
#       every process finds on disk what the others finished. The parity tests' and checks' results count; the
#       benchmarks' timings are not rows (compilation ran inside them, beside the others).
#   PHASE=rows bash benchmarks/gpu_hybrid_rows.sh    the rows, one after another, alone on the machine.
#
# JOBS: the benchmark jobs, "NAME@ROUTE ..." (NAME from BENCHES below; ROUTE one of benchmarks/gdn_kernels.py's:
# flash_qla, fla_tilelang = fla 0.6's Triton kernels with the gated dqkwg backward on TileLang, which fla picks by
# default on Hopper with Triton >= 3.4 once tilelang imports, fla_triton); default: every benchmark on ROUTE (default
# fla_tilelang). PARITY_ROUTES (default: the jobs' routes) and PARITY_K (pytest -k, within those) select the parity
# tests; CHECKS="ROUTE:K ..." runs benchmarks/gdn_kernel_check.py on ROUTE's cases of head size K in the warm phase.
# A one-call warm-up does not fit: the first process on a machine spends minutes compiling each kernel's autotuning
# configs, one after another (the reason the rows of gpu_hybrid_kernels.sh ran out of time). Side by side the warm
# phase's processes can exhaust the GPU's memory or crash (seen once each: an out-of-memory error, a segfault in a
# benchmark's backward); whatever they compiled before stays on disk. Packages and caches: benchmarks/hybrid_env.sh
# (carry .whl/hybrid); every route runs on fla 0.6 with FlashQLA and TileLang importable, `gdn_kernels.select`
# picking the route. Results under $OUT: hybrid_<phase>.tgz (every log and JSON of the phase), triton_autotune.tgz
# (Triton's autotuning results, for a later machine's TRITON_CACHE_DIR), and the phase's status lines on stdout.
set -uo pipefail
START=$SECONDS
PHASE=${PHASE:?PHASE=warm or PHASE=rows}
BUDGET=${BUDGET:-540}
JOB_ROUTE=${ROUTE:-fla_tilelang}  # (hybrid_env.sh's ROUTE is its label -> route map)
OUT=${OUT:-/tmp/hybrid_out}
W=/tmp/hyb
R=$W/$PHASE
mkdir -p "$OUT" "$R"
source benchmarks/hybrid_env.sh
export PYTHONPATH
PYTHONPATH=$(pypath flash_qla)  # fla 0.6 with FlashQLA and TileLang: every fla 0.6 route
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

# The benchmarks: NAME SCRIPT ARGS... (a job NAME@ROUTE writes $R/NAME_ROUTE.json; ROUTE replaces fla_tilelang).
BENCHES=(
  "qwen3.5-0.8b_grpo benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --workloads grpo_G16_P4096_C512 \
    --scale 0.25 --repeats 1 --gdn-route fla_tilelang"
  "qwen3.5-0.8b_agent20 benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --workloads agent_20_turns \
    --scale 0.25 --repeats 1 --gdn-route fla_tilelang"
  "levels benchmarks/bench_levels.py --device cuda --heads 16 --dim 128 --scale 1 --gdn-route fla_tilelang"
  "qwen3.5-2b_grpo benchmarks/bench_tree_vs_flat.py --models qwen3.5-2b --workloads grpo_G16_P4096_C512 \
    --scale 0.25 --repeats 1 --gdn-route fla_tilelang"
  "qwen3.5-2b_agent20 benchmarks/bench_tree_vs_flat.py --models qwen3.5-2b --workloads agent_20_turns \
    --scale 0.25 --repeats 1 --gdn-route fla_tilelang"
)
declare -A SPEC
for spec in "${BENCHES[@]}"; do SPEC[${spec%% *}]=$spec; done
JOBS=${JOBS:-$(for spec in "${BENCHES[@]}"; do echo -n "${spec%% *}@$JOB_ROUTE "; done)}
read -r -a JOBS <<<"$JOBS"
for job in "${JOBS[@]}"; do
  [ -n "${SPEC[${job%@*}]:-}" ] || { echo "unknown benchmark in JOBS: $job (one of: ${!SPEC[*]})"; exit 1; }
done
job_cmd() {  # job_cmd NAME@ROUTE: the job's command line
  local name=${1%@*} route=${1#*@} args
  read -r -a args <<<"${SPEC[$name]}"
  echo python3 "${args[@]:1}" | sed "s/--gdn-route fla_tilelang/--gdn-route $route/" | tr -d '\n'
  echo " --out $R/${name}_$route.json"
}
PARITY_ROUTES=${PARITY_ROUTES:-$(for job in "${JOBS[@]}"; do echo "${job#*@}"; done | sort -u | xargs)}

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
  routes_k=$(echo "$PARITY_ROUTES" | sed 's/ / or /g')
  mapfile -t tests < <(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/test_gpu_recurrent.py \
    -k "($routes_k or uses_the_varlen)${PARITY_K:+ and ($PARITY_K)}" 2>/dev/null | grep "::")
  read -r -a checks <<<"${CHECKS:-}"
  note "warm: ${#tests[@]} parity tests, ${#checks[@]} kernel checks and ${#JOBS[@]} benchmark jobs at once," \
    "limit $WARM_MAX s"
  for i in "${!tests[@]}"; do
    launch "parity_$i" python3 -m pytest -v -s -rfEs -m gpu -p no:cacheprovider "${tests[$i]}"
  done
  for check in "${checks[@]}"; do
    launch "check_${check%:*}_k${check#*:}" python3 benchmarks/gdn_kernel_check.py --route "${check%:*}" \
      --head-dims "${check#*:}" --out "$R/check_${check%:*}_k${check#*:}.json"
  done
  for job in "${JOBS[@]}"; do
    # the 2B model's Gated DeltaNet layers have the 0.8B's heads: the 0.8B run of the workload warms its kernels
    [[ $job == qwen3.5-2b_* && " ${JOBS[*]} " == *" ${job/2b/0.8b} "* ]] && continue
    # shellcheck disable=SC2046
    launch "${job/@/_}" $(job_cmd "$job")
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  for i in "${!tests[@]}"; do
    result=$(grep -E "^=+ .*(passed|failed|error|skipped).* in [0-9.]+s" "$R/parity_$i.log" | tail -1 | tr -d =)
    note "${tests[$i]#tests/test_gpu_recurrent.py::}: ${result:-no result (time limit?)}"
    grep -E "^E |: (kernels|flat on|worst)" "$R/parity_$i.log" | head -6 | cut -c1-300
  done
  for check in "${checks[@]}"; do
    log=$R/check_${check%:*}_k${check#*:}.log
    note "check $check: $(grep -c '"status"' "$log") cases;" \
      "$(grep -o '"K": [0-9]*, "heads": [0-9]*, "dtype": "[a-z0-9]*", "guard_lifted": [a-z]*, "status": "[a-z]*"' \
        "$log" | tr '\n' ';' | cut -c1-600)"
  done
  for job in "${JOBS[@]}"; do
    log=$R/${job/@/_}.log
    [ -f "$log" ] && note "warm $job: $(autotunings "$log");" \
      "$(grep -v -i -E "warn|^\[transformers\]|autotuning|with key|finished after|best config" "$log" \
        | tail -2 | cut -c1-300)"
  done
  note "parity processes: $(cat "$R"/parity_*.log | autotunings)"
else
  for job in "${JOBS[@]}"; do
    t=$(($(left) - 15))
    if ((t < 30)); then note "$job: skipped, out of time"; continue; fi
    t0=$SECONDS
    # shellcheck disable=SC2046
    timeout -k 5 "$t" $(job_cmd "$job") >"$R/${job/@/_}.log" 2>&1
    rc=$?
    note "$job: rc=$rc in $((SECONDS - t0)) s$( ((rc == 124)) && echo ' (time limit)')"
    grep -v -i -E "warn|^\[transformers\]" "$R/${job/@/_}.log" | tail -4 | cut -c1-400
  done
fi
finish
