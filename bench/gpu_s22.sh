#!/bin/bash
# One device call: the one-row attention fusion (attention_kernels.ONE_ROW_FUSE) checked and timed alone, then in
# the A3B step (BF16 and Q4_0), side by side with the three launches it replaces. Carry .whl (gguf and friends).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 bench/attn_one.py --contexts 1024,4096,16384,32768,131072 --checks 24 --max-seconds 120 2>&1 | tail -60
python3 bench/step_ab.py --contexts ${CTX:-1024,4096,16384,32768,131072} --widths 1 \
  --arms fuse0,fuse1,fuse2,fuse2-notrig --rounds 5 --steps 30 --quant q4_0 --quant-arms fuse0,fuse2,fuse2-nopdl 2>&1 | tail -80
