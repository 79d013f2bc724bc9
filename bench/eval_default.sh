#!/usr/bin/env bash
# Evaluation benchmark: the default model in fp32 against bitsandbytes int8 and NF4, on the
# whole WikiText-2 test set (windows of 2048), the four zero-shot tasks in full (fp32) and
# decode speed. About 75 minutes on 2 CPU cores. Extra arguments are passed to slimlm
# (e.g. eval=quick for the 3-minute profile). BENCH_RECIPE=evaluate BENCH_NAME=eval_full_fp32
# times the whole evaluation of the fp32 model alone.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
name=${BENCH_NAME:-eval_default}
notes=$( [ -f "bench/$name.notes.md" ] && echo "bench/$name.notes.md" || true )
run_dir=bench/runs/$name-$(date +%Y%m%d-%H%M%S)
.venv/bin/slimlm recipe=${BENCH_RECIPE:-eval-peers} eval=full data=shared hydra.run.dir="$run_dir" "$@"
.venv/bin/python bench/publish.py "$name" "$run_dir" --command "${BENCH_RECIPE:+BENCH_RECIPE=$BENCH_RECIPE }${BENCH_NAME:+BENCH_NAME=$BENCH_NAME }bash bench/eval_default.sh $*"${notes:+ --notes "$notes"}
