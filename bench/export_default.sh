#!/usr/bin/env bash
# Export benchmark: the default model at int4 g64 GPTQ written as a slimlm artifact and as a
# compressed-tensors checkpoint, each reloaded from disk and measured on the same slice (the first
# 16 windows of 2048 tokens of WikiText-2 test), then a greedy completion. About 10 minutes on
# 2 CPU cores. Extra arguments go to slimlm.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
name=export_default
run_dir=bench/runs/$name-$(date +%Y%m%d-%H%M%S)
.venv/bin/slimlm recipe=w4-gptq-export data=shared eval=slice64 eval.perplexity.max_windows=16 hydra.run.dir="$run_dir" "$@"
notes=$( [ -f "bench/$name.notes.md" ] && echo "bench/$name.notes.md" || true )
.venv/bin/python bench/publish.py "$name" "$run_dir" --command "bash bench/export_default.sh $*"${notes:+ --notes "$notes"}
