#!/usr/bin/env bash
# The GPU measurements waiting for a device (the CPU sessions built what they measure), in one call of about
# 8 minutes. Run from the repository root on the device with $OUT set; carry .whl (wheels for gguf, questionary,
# platformdirs, tomli_w, prompt_toolkit, wcwidth: `pip download -q --no-deps -d .whl gguf questionary platformdirs
# tomli_w prompt_toolkit wcwidth`). Each part writes its log under $OUT.
#   1. attention_kernels.ROW_TILE_ONE (issue of decode at 60% of the bound from 1k context): the one-row step
#      with 16 and 32 lines a tile against the shipped 64, then the row-invariance check of the attention parts.
#   2. The formats read since the last GPU run (Q5_K, Q3_K, Q2_K, IQ4_XS): the GPU paths against
#      dequantize-then-matmul, then decode speed of the Q5_K_M and Q3_K_M-like mixes and the plain formats next to
#      Q4_K_M and Q4_0.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
start=$(date +%s)
echo "--- ROW_TILE_ONE ($(( $(date +%s) - start )) s)"
timeout 200 python3 bench/step_ab.py --contexts 1024,4096,16384,32768 --widths 1 --arms default,rt1-16,rt1-32 \
  2>&1 | tail -30 | tee "$OUT/rt1.log"
timeout 120 python3 bench/context.py --check --check-parts attention 2>&1 | tail -15 | tee "$OUT/rt1_check.log"
echo "--- K-quants ($(( $(date +%s) - start )) s)"
timeout 260 python3 bench/quant_target.py --device cuda --part speed --check \
  --quants q4_k_m,q5_k_m,q3_k_m,q5_k,q3_k,q2_k,iq4_xs,q4_0 --max-seconds 230 2>&1 | tail -40 | tee "$OUT/kquant.log"
echo "--- done in $(( $(date +%s) - start )) s"
