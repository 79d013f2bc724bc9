#!/usr/bin/env bash
# Run recipes on the default model into bench/runs/NAME/<recipe>, each on the same evaluation
# slice (eval=slice64 unless EVAL is set), then publish them as one result bench/results/NAME.
#
#     bash bench/run_recipes.sh NAME RECIPE [RECIPE ...] [-- SLIMLM_ARG ...]
#
# A run that finished is kept and one that was interrupted resumes in its directory (slimlm picks up
# block-by-block calibration and training checkpoints; delete a run's directory to redo it).
# Arguments after `--` go to every slimlm run; DATA chooses the data option (default shared).
set -euo pipefail
cd "$(dirname "$0")/.."
name=$1; shift
recipes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do recipes+=("$1"); shift; done
[ $# -gt 0 ] && shift
make setup
root=bench/runs/$name
for recipe in "${recipes[@]}"; do
  run_dir=$root/$recipe
  if grep -qs '"complete"' "$run_dir/status.json"; then
    echo "$recipe: finished earlier, kept"
    continue
  fi
  .venv/bin/slimlm recipe="$recipe" eval="${EVAL:-slice64}" data="${DATA:-shared}" hydra.run.dir="$run_dir" "$@"
done
notes=$( [ -f "bench/$name.notes.md" ] && echo "bench/$name.notes.md" || true )
.venv/bin/python bench/publish.py "$name" "${recipes[@]/#/$root/}" --command "${BENCH_COMMAND:-bash bench/$name.sh $*}"${notes:+ --notes "$notes"}
