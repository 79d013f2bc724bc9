#!/usr/bin/env bash
# LoRA recovery, deployed: `recipe=w4-lora-recover` (w4 g64 GPTQ, rank-16 adapters distilled on
# the frozen codes from the fp32 model, 64k tokens) exported as a slimlm artifact with the
# adapters beside the codes, reloaded and re-measured on the first 16 windows of 2048 tokens of
# WikiText-2 test, then a greedy completion through the bundled decoder; then
# bench/lora_decode_cpu.py times the artifact's decoding with and without its adapters. About
# 20 minutes on 2 CPU cores, 45 the first time (compiling the two decoders' steps); a finished
# recipe run is kept (bench/run_recipes.sh). Extra arguments go to slimlm.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH_COMMAND="bash bench/lora_deploy.sh $*" bash bench/run_recipes.sh lora_deploy w4-lora-recover -- eval.perplexity.max_windows=16 "$@"
.venv/bin/python bench/lora_decode_cpu.py --artifact bench/runs/lora_deploy/w4-lora-recover/artifact
