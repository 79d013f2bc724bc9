#!/usr/bin/env bash
# Evaluation benchmark: the default model in fp32 against bitsandbytes int8 and NF4, on the
# whole WikiText-2 test set (windows of 2048), the four zero-shot tasks in full (fp32) and
# decode speed. About 75 minutes on 2 CPU cores. Extra arguments are passed to slimlm
# (e.g. eval=quick for the 3-minute profile).
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
name=${BENCH_NAME:-eval_default}
run_dir=bench/runs/$name-$(date +%Y%m%d-%H%M%S)
.venv/bin/slimlm recipe=eval-peers eval=full data=shared hydra.run.dir="$run_dir" "$@"
.venv/bin/python bench/publish.py "$run_dir" "$name" --command "bash bench/eval_default.sh $*" --notes bench/eval_default.notes.md
