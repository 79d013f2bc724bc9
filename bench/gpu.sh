#!/usr/bin/env bash
# Every GPU check in one run (GPTQ calibration, then the decoder), for a machine with a CUDA GPU whose python3 already
# has torch and transformers (slimlm's other dependencies are not needed, nor is a network):
# bench/decode_gpu.py's sections, about 6-8 minutes on one H200 (see that file), results in
# bench/results/decode_gpu.{md,json} and, when $OUT is set, copied there too.
#
#     bash bench/gpu.sh [decode_gpu.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(mktemp -d)
# slimlm itself, without its dependencies: whatever the image lacks stays lazily imported. Where
# pip cannot build it (no setuptools, no network for build isolation), lay out the same package
# tree by hand: the stage folders sit under slimlm/ as pyproject.toml's package-dir maps them.
if ! python3 -m pip install --quiet --no-deps --no-build-isolation --no-index --target "$site" . >"$site/install.log" 2>&1; then
    tail -3 "$site/install.log"
    echo "pip could not install slimlm; copying its package tree instead"
    rm -rf "${site:?}"/* && cp -r slimlm "$site/slimlm"
    for stage in compress distill eval inference conf; do cp -r "$stage" "$site/slimlm/$stage"; done
    cp -r recipes "$site/slimlm/recipe"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
status=0
# Calibration first (about a minute): GPTQ one block at a time on the GPU against the CPU. The
# compression stages need omegaconf and hydra; where the image lacks them, carry the CPU
# machine's copies (.venv's site-packages folders omegaconf, hydra, antlr4) and set
# SLIMLM_GPU_DEPS to the folder that holds them.
export PYTHONPATH="${SLIMLM_GPU_DEPS:+$SLIMLM_GPU_DEPS:}$PYTHONPATH"
if python3 -c "import omegaconf, hydra" 2>/dev/null; then
    python3 bench/calibrate_gpu.py || status=$?
else
    echo "calibrate_gpu.py skipped: no omegaconf/hydra here (see SLIMLM_GPU_DEPS above)"
fi
python3 bench/decode_gpu.py "$@" || status=$?
if [ -n "${OUT:-}" ]; then cp bench/results/decode_gpu.* bench/results/calibrate_gpu.* "$OUT"/ 2>/dev/null || true; fi
exit $status
