#!/bin/bash
# Device calls of bench/results/h200_session22/: the one-row attention fusion (attention_kernels.ONE_ROW_FUSE)
# checked and timed alone, then the A3B step with it and with the routing in the router product
# (dense_kernels.FUSE_ROUTE), side by side with the launches they replace. Carry .whl (gguf and friends).
# PART=1 (default): attn_one + BF16 step at 1k-32k; PART=2: 128k and Q4_0; PART=3: bench/context.py with them.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv
if [ "${PART:-1}" = 1 ]; then
  python3 bench/attn_one.py --contexts 1024,16384 --checks 6 --max-seconds 30 2>&1 | tail -50
  python3 bench/step_ab.py --contexts ${CTX:-1024,16384} --widths 1 --rounds 3 --steps 30 \
    --arms before22,fuse2r,fuse3r 2>&1 | tail -40
elif [ "${PART}" = 3 ]; then     # the issue table with the chosen fusions (FUSE: attention_kernels.ONE_ROW_FUSE)
  python3 bench/context.py --no-hf --prefill 8192 --kv bf16 --one-row-fuse ${FUSE:-2} --fuse-route 1 \
    --max-seconds 300 2>&1 | tail -40
else
  python3 bench/step_ab.py --contexts 131072 --widths 1 --arms before22,fuse1r,fuse2r,fuse3r --rounds 5 --steps 20 \
    --quant q4_0 --quant-arms before22,fuse2r,fuse2r-nopdl,fuse3r 2>&1 | tail -40
fi
