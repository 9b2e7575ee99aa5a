#!/usr/bin/env bash
# The GPU measurements waiting for a device (a CPU session built what they measure), in two calls of about 5
# minutes each: `bash bench/gpu_next.sh 1`, then `bash bench/gpu_next.sh 2`. Run from the repository root on the
# device with $OUT set; carry .whl (wheels for gguf, questionary, platformdirs, tomli_w, prompt_toolkit, wcwidth:
# `pip download -q --no-deps -d .whl gguf questionary platformdirs tomli_w prompt_toolkit wcwidth`). Each part
# writes its log and JSON under $OUT.
#   1. The one-row MoE half in one persistent launch (runtime/gpu/moe_row.py) alone, against the four launches the
#      step ships, BF16 and Q4_0 experts, every tile candidate (bench/moe_row.py). Look first at "same experts" and
#      at any "A BARRIER GAVE UP" (the grid was not all resident: a bug in `_programs`).
#   2. The same in the one-row step (arms default / moe-row; for Q4_0 also moe-row-q-w8, 8 warps, RU = RD = 2), at 1k and
#      16k context. If an arm wins, set its tile in moe_row.TILE / QTILE, turn moe_row.ENABLED on and make the
#      step_ab default arm carry "moe_row" (the figures go to docs/models.md "The one-row MoE in one launch").
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
if [ "${1:-1}" = 1 ]; then
  echo "--- moe_row alone, BF16 ($(( $(date +%s) - start )) s)"
  timeout 200 python3 bench/moe_row.py --max-seconds 170 2>&1 | grep -v Warning | tail -24 | tee "$OUT/moe_row_bf16.log"
  echo "--- moe_row alone, Q4_0 ($(( $(date +%s) - start )) s)"
  timeout 200 python3 bench/moe_row.py --quant q4_0 --max-seconds 170 2>&1 | grep -v Warning | tail -22 \
    | tee "$OUT/moe_row_q4_0.log"
else
  echo "--- the one-row step with and without moe_row ($(( $(date +%s) - start )) s)"
  timeout 500 python3 bench/step_ab.py --contexts 1024,16384 --widths 1 --arms default,moe-row --quant q4_0 \
    --quant-arms default,moe-row,moe-row-q-w8 --rounds 5 2>&1 | tail -30 | tee "$OUT/step_ab_moe_row.log"
fi
echo "--- done in $(( $(date +%s) - start )) s"
