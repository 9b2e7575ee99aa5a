#!/usr/bin/env bash
# llama.cpp beside our runtime on one GPU, the Qwen3-30B-A3B shape, in two calls of the device tool on one warm
# machine: `bash bench/peer_llama.sh 1` (build llama-bench, write the Q4_0 model, run llama-bench), then
# `bash bench/peer_llama.sh 2` (ours: the same depths per target quant, and the BF16 contexts and an 8k prefill).
# Run from the repository root on the device with $OUT set; carry `.peer` (llama.cpp's sources from the
# llama-cpp-python sdist, trimmed to fit the device tool's 64 MiB: docs/peers.md says how) and `.whl`
# (wheels for gguf, questionary, platformdirs, tomli_w, prompt_toolkit, wcwidth). The build and the 17 GB model go
# to /tmp on the device (a carried path is replaced at every call), so part 2 and a repeat of part 1 reuse them while
# the machine stays warm. Each part writes its logs and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${1:-1}" = 1 ]; then
  L=.peer/llama.cpp
  B=/tmp/llama-build
  if [ ! -x "$B/bin/llama-bench" ]; then
    echo "--- building llama-bench ($(( $(date +%s) - start )) s)"
    cmake -B "$B" -S "$L" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
      -DCMAKE_BUILD_TYPE=Release \
      > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
    cmake --build "$B" -j 16 --target llama-bench > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  fi
  grep -m1 "ggml version" "$OUT/cmake.log" 2>/dev/null > "$OUT/llama_cpp_version.txt" || true   # the sdist has no git
  if [ ! -f /tmp/a3b.gguf ]; then
    echo "--- writing the A3B-shaped Q4_0 model ($(( $(date +%s) - start )) s)"
    PYTHONPATH="$L/gguf-py" python3 bench/peer_a3b_gguf.py /tmp/a3b.gguf > "$OUT/model.log" 2>&1 \
      || { tail -20 "$OUT/model.log"; exit 1; }
  fi
  echo "--- llama-bench ($(( $(date +%s) - start )) s)"
  timeout 400 "$B/bin/llama-bench" -m /tmp/a3b.gguf -ngl 99 -fa 1 -p 512,8192 -n 128 -d 0,4096,32768 -r 2 -o md \
    2> "$OUT/llama_bench.err" | tee "$OUT/llama_bench.md"
  python3 -c "
import json, sys
sys.path.insert(0, '.')
from bench.common import copy_bandwidth
bw = copy_bandwidth() / 1e9
json.dump({'copy_GBs': bw}, open('$OUT/copy.json', 'w'))
print('copy bandwidth', round(bw), 'GB/s')"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  echo "--- ours: decode per target quant after prompts of 0 / 4k / 32k ($(( $(date +%s) - start )) s)"
  timeout 280 python3 bench/quant_target.py --part speed --quants bf16,q8_0,q4_0 --depths 4096,32768 \
    --max-seconds 240 2>&1 | grep -v Warning | tail -30 | tee "$OUT/quant_target.log"
  echo "--- ours: BF16 decode at 1k / 4k / 16k and an 8k prefill ($(( $(date +%s) - start )) s)"
  timeout 280 python3 bench/context.py --no-hf --contexts 1024,4096,16384 --prefill 8192 --kv bf16 \
    --max-seconds 240 2>&1 | grep -v Warning | tail -30 | tee "$OUT/context.log"
fi
echo "--- done in $(( $(date +%s) - start )) s"
