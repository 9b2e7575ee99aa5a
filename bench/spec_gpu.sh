#!/usr/bin/env bash
# The GPU runs of the speculation work, on one H200 (device tool; carry .gpu_carry and training/data):
#   bash bench/spec_gpu.sh train   # ~5 min: re-train the default DFlash2 head with one layer (training/train_head.py)
#   bash bench/spec_gpu.sh bench   # ~4 min: spec_scale --check, then spec_scale (A3B-cost speculation)
#   bash bench/spec_gpu.sh all     # both in one call (~9 min): the bench measures the new head, the old one beside it
# Results in $OUT: strata-nano-dflash2.tar, train_head.json/.jsonl (train); spec_scale_check.json, spec_scale.json,
# spec_scale.log (bench). `.gpu_carry` holds the gguf wheel (the Q8_0/Q4_0 rows; without it they are skipped), made
# as bench/gpu_final.sh says; `training/data` comes from `python -m training.corpus --out training/data`.
set -u
export PYTHONUNBUFFERED=1
stage="${1:-all}"
start=$(date +%s)
if ls .gpu_carry/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu_carry/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
extra=""
if [ "$stage" = train ] || [ "$stage" = all ]; then
  echo "--- train_head ($(( $(date +%s) - start )) s)"
  timeout 330 python3 -m training.train_head --data training/data --out "$OUT" --work /tmp/th --layers 1 \
    --seconds "${TRAIN_SECONDS:-160}" 2>&1 | tail -6
  if [ "$stage" = all ] && [ -f "$OUT/strata-nano-dflash2.tar" ]; then
    cp -r setup_wizard/bundled/strata-nano-dflash2 /tmp/head-before
    python3 -c 'import sys; from pathlib import Path; from training.export import untar_safely
untar_safely(Path(sys.argv[1]), Path("setup_wizard/bundled"))' "$OUT/strata-nano-dflash2.tar"
    extra="--extra-head /tmp/head-before:before"
  fi
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  echo "--- spec_scale --check ($(( $(date +%s) - start )) s)"
  timeout 120 python3 bench/spec_scale.py --check $extra 2>&1 | tail -4
  echo "check rc=${PIPESTATUS[0]}"
  left=$(( 580 - ($(date +%s) - start) ))
  echo "--- spec_scale ($(( $(date +%s) - start )) s, ${left} s left)"
  timeout "$left" python3 bench/spec_scale.py --max-seconds $(( left - 45 )) $extra > "$OUT/spec_scale.log" 2>&1
  echo "bench rc=$?"
  tail -75 "$OUT/spec_scale.log"
fi
echo "--- done in $(( $(date +%s) - start )) s"
