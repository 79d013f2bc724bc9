#!/usr/bin/env bash
# Quantization benchmark: the default model in fp32; w8 RTN (LM head included); w4 and w3 g64
# symmetric RTN / GPTQ / AWQ; GPTQ with per-layer mixed precision at 3.5 bits per weight; and
# bitsandbytes int8 and NF4 as peers. Every row on the same slice: the first 64 windows of 2048
# tokens of WikiText-2 test (eval=slice64). About 75 minutes on 2 CPU cores; resumable (see
# bench/run_recipes.sh). Extra arguments go to every slimlm run.
set -euo pipefail
exec bash "$(dirname "$0")/run_recipes.sh" quantize_default w8-rtn w4-rtn w4-gptq w4-awq w3-rtn w3-gptq w3-awq mixed-3.5bpw eval-peers -- "$@"
