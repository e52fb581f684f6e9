#!/usr/bin/env bash
# TRL's own GRPO tests (tests/test_grpo_trainer.py at the commit in TRL_COMMIT.txt), offline on the CPU, with TRL's
# GRPOTrainer and with TreeGRPOTrainer substituted for it; then the table of outcomes.
#
#   tests/trl_suite/run.sh TRL_GIT WORK_DIR [both|trl|tree] [CHUNK]
#
# TRL_GIT: a clone (or bare mirror) of https://github.com/huggingface/trl holding that commit. WORK_DIR: outside the
# repository; TRL's files are copied there at run time and never committed. PYTHON (default: the repository's .venv,
# as `make install` makes it, with the train and test extras) runs everything. Tests run in chunks of CHUNK
# (default 4), each chunk in its own process under `timeout $CHUNK_TIMEOUT` (default 3000 s), one thread, JOBS
# (default 1) chunks at a time. A run resumes: tests with a recorded outcome in WORK_DIR/runs/<trainer>/results.jsonl
# are not run again (FRESH=1 starts over). One core takes about 2.5 h for the tree trainer's run, TRL's longer (its
# training tests take 5-15 min each).
# The table: `python WORK_DIR/summarize.py WORK_DIR [-v | --markdown]`.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
project=$(cd "$here/../.." && pwd)
git_dir=$(cd "${1:?TRL_GIT: a git clone of huggingface/trl}" && pwd)
work=${2:?WORK_DIR: a directory outside the repository}
which=${3:-both}
chunk=${4:-4}
chunk_timeout=${CHUNK_TIMEOUT:-3000}
jobs=${JOBS:-1}
python=${PYTHON:-$project/.venv/bin/python}
commit=$(cut -d' ' -f1 "$here/TRL_COMMIT.txt")

mkdir -p "$work/tests" "$work/gen_ref"
work=$(cd "$work" && pwd)
cp "$here"/{conftest.py,offline_assets.py,collect_plugin.py,summarize.py,selected_ids.txt,TRL_COMMIT.txt} "$work/"
cp "$here/pytest_trl.ini" "$work/pytest.ini"
for f in __init__.py conftest.py test_grpo_trainer.py testing_constants.py testing_utils.py; do
  git -C "$git_dir" show "$commit:tests/$f" > "$work/tests/$f"
done
git -C "$git_dir" show "$commit:scripts/generate_zen_dataset.py" > "$work/gen_ref_zen.py"
git -C "$git_dir" archive "$commit" scripts/generate_tiny_models | tar x -C "$work/gen_ref"

cd "$work"
export PROJECT_DIR=$project PYTHONPATH=$project HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=1 TRL_EXPERIMENTAL_SILENCE=1
[ -f hub/.complete ] || "$python" offline_assets.py
ln -sfn hub/trl-internal-testing trl-internal-testing
# The tool-calling tests need jmespath (their @require_jmespath skips them otherwise); optional, so never fatal.
[ -d extra_site ] || "$python" -m pip install -q --no-deps --target extra_site jmespath || true
LIST_OUT=collected.json "$python" -m pytest tests/test_grpo_trainer.py --collect-only -q -p collect_plugin \
  -p no:cacheprovider > /dev/null

run_chunk() {  # run_chunk <trainer> <chunk file>: one process for the chunk's tests, its own temporary directory
  local trainer=$1 part=$2 dir=runs/$1 ids
  mapfile -t ids < "$part"  # test ids hold brackets: no word splitting or globbing
  TRL_PEER_TRAINER=$trainer TRL_PEER_RESULTS=$dir/results.jsonl TRL_PEER_EVENTS=$dir/events.jsonl \
    timeout "$chunk_timeout" "$python" -m pytest "${ids[@]}" -p no:cacheprovider -q -rfEsxX --tb=short \
    --basetemp="$work/tmp_$trainer/$(basename "$part")" > "$part.log" 2>&1 || true
  echo "== $(date +%T) $trainer $(basename "$part") ($(wc -l < "$part") tests): $(tail -1 "$part.log")"
}

run() {  # run <trl|tree>: every selected test without a recorded outcome, in chunks, JOBS chunks at a time
  local trainer=$1 dir=runs/$1
  local stamp
  stamp=$(date +%Y%m%d%H%M%S)
  if [ "${FRESH:-0}" = 1 ]; then rm -rf "$dir"; fi
  mkdir -p "$dir" "$work/tmp_$trainer"
  "$python" summarize.py "$work" --todo "$trainer" > "$dir/todo_$stamp.txt"
  [ -s "$dir/todo_$stamp.txt" ] || return 0
  split -l "$chunk" -d -a 3 "$dir/todo_$stamp.txt" "$dir/chunk_${stamp}_"
  export -f run_chunk
  export work python chunk_timeout
  # Each test appends one line to the results file (a short O_APPEND write), so parallel chunks do not mix lines.
  printf '%s\n' "$dir/chunk_${stamp}_"??? | xargs -P "$jobs" -I{} bash -c 'run_chunk "$0" "$1"' "$trainer" {}
}
case $which in
  both) run trl; run tree ;;
  trl | tree) run "$which" ;;
  *) echo "which trainer: both, trl or tree (got $which)" >&2; exit 2 ;;
esac
"$python" summarize.py "$work"  # exits 1 if a test passes with TRL's trainer and not with the tree trainer
