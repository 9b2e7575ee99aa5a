#!/bin/bash
# The device calls that decide the one-row fusions (docs/models.md, "A one-row window's attention in one launch"):
# attention_kernels.ONE_ROW_FUSE (the q/k/v post-processing, split attention and reduction of a one-row window in
# one or two launches) and dense_kernels.FUSE_ROUTE (the routing in the router product's last program), both
# shipped off until these runs show them correct and faster. Carry .whl (gguf and friends).
# PART=1 (default, about 7 minutes): bench/attn_one.py (the fused forms against the three launches with NaN in the
# written slot, then timed alone) and the A3B one-row step at 1k-32k, side by side with the launches they replace;
# PART=2: 128k and a Q4_0 target; PART=3: bench/context.py's table with FUSE=N and the routing fusion on.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv
if [ "${PART:-1}" = 1 ]; then
  python3 bench/attn_one.py --contexts 1024,4096,16384,32768,131072 --checks 16 --max-seconds 90 2>&1 | tail -50
  python3 bench/step_ab.py --contexts ${CTX:-1024,4096,16384,32768} --widths 1 --rounds 5 --steps 30 \
    --arms before22,fuse1r,fuse2r,fuse3r,fuse2 2>&1 | tail -40
elif [ "${PART}" = 3 ]; then
  python3 bench/context.py --no-hf --prefill 8192 --kv bf16 --one-row-fuse ${FUSE:-2} --fuse-route 1 \
    --max-seconds 300 2>&1 | tail -40
else
  python3 bench/step_ab.py --contexts 131072 --widths 1 --arms before22,fuse1r,fuse2r,fuse3r --rounds 5 --steps 20 \
    --quant q4_0 --quant-arms before22,fuse2r,fuse2r-nopdl,fuse3r 2>&1 | tail -40
fi
