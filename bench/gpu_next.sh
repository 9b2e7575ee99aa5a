#!/usr/bin/env bash
# The GPU measurements waiting for a device (the CPU sessions built what they measure), in one call of about
# 6 minutes. Run from the repository root on the device with $OUT set; carry .whl (wheels for gguf, questionary,
# platformdirs, tomli_w, prompt_toolkit, wcwidth: `pip download -q --no-deps -d .whl gguf questionary platformdirs
# tomli_w prompt_toolkit wcwidth`). Each part writes its log under $OUT.
#   1. The matrix-vector tiles of Q3_K, Q2_K and IQ4_XS at W = 8 and 16 (their tiles were chosen by the one-row
#      step, bench/results/h100_session23/tiles/): every GEMV variant timed against the shipped one.
#   2. The formats read in blocks, checked against dequantize-then-matmul, then decode speed (the H100 figures of
#      bench/results/h100_session23/ are the baseline): run it again after any change to moe_gemv's row loops.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
start=$(date +%s)
echo "--- GEMV tiles of Q3_K, Q2_K, IQ4_XS ($(( $(date +%s) - start )) s)"
timeout 200 python3 bench/moe.py --tune-decode --formats q3_k,q2_k,iq4_xs --max-seconds 170 2>&1 | tail -45 \
  | tee "$OUT/tune.log"
cp bench/results/moe_tune_decode.json "$OUT/" 2>/dev/null
echo "--- formats read in blocks ($(( $(date +%s) - start )) s)"
timeout 260 python3 bench/quant_target.py --device cuda --part speed --check \
  --quants q4_k_m,q5_k_m,q3_k_m,q2_k,iq4_xs,iq4_nl,q4_0 --max-seconds 230 2>&1 | tail -40 | tee "$OUT/kquant.log"
cp bench/results/quant_target.json "$OUT/" 2>/dev/null
echo "--- done in $(( $(date +%s) - start )) s"
