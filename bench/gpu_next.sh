#!/usr/bin/env bash
# The GPU measurements waiting for a device (sessions without an H200 built or changed what they measure), in three
# calls of 1-4 minutes each: `bash bench/gpu_next.sh 1`, `2`, `3`. Run from the repository
# root on the device with $OUT set; carry .whl (wheels for gguf, questionary, platformdirs, tomli_w, prompt_toolkit,
# wcwidth: `pip download -q --no-deps -d .whl gguf questionary platformdirs tomli_w prompt_toolkit wcwidth`). Each
# part writes its logs and JSON under $OUT. Say which card ran it: the figures below are an H100's.
#   1. The graphed one-row step kernel by kernel (`bench/step_timeline.py` at 1k and 16k), the long-context table
#      on this card (`bench/context.py`: decode at 1k-128k, one and 8 rows, BF16 and q8_0 caches of 40,960
#      positions as a default A3B engine holds, prefill at the 2048- and 8192-token chunks; the goal
#      figures), then the one-row q8_0 attention tile against its forms before (arms rt1-64: 64 lines, no cap;
#      q8-one-nocap: 16 lines, no register cap; H100: 9.17 / 8.68 / 7.89 ms at 131k).
#   2. Windows of 8 rows over a q8_0 cache on 32- and 16-line tiles (attention_kernels.ROW_TILE_Q8; H100: 21.4 ms at
#      131k on 64 lines, against 17.1 over BF16), and the Q4_K / Q4_K_M targets' decode (the Q4_K rows-one-at-a-time
#      experts, H100: 376 and 355 tok/s).
#   3. On an H200, what an H100 measured (bench/results/h100_session37/top_pf/, h100_session38/): the step before
#      (o-lean) against o_proj letting the router in at its start plus the split attention asking its first chunk's
#      K/V into L2 before its PDL wait (default; H100 3.08 / 3.12 / 3.67 / 4.26 -> 3.06 / 3.07 / 3.60 / 4.18 ms at
#      1k / 4k / 16k / 32k), the split letting the reduction in first too (trig-split; H100 no change), 64-position
#      chunks up to 4k (tiers-64to4k; H100 faster at 1k, slower from 4k), o_proj's programs on the SMs running
#      split programs loading after their wait (o-aware; the same shape); on 40,960-position caches; then the
#      timeline of one arm (`bash bench/gpu_next.sh 3 ARM`, default: the default).
#   4. o_proj's programs on the split's SMs loading after their wait only while few split programs work (o-aware32,
#      o-aware64: pdl.MARK_MAX), four-tier chunk layouts with 64-position chunks up to 1k or 2k (tiers4-64to1k,
#      tiers4-64to2k), and both, at 1k-16k on 40,960-position caches; then, on an H200 only, the context table
#      (part 1's) for the issue's goal figures (`bash bench/gpu_next.sh 4 arms-only`: the arms alone).
#   5. The one-row experts split over the intermediate (runtime/gpu/moe_split.py): each tile alone against the
#      shipped launches (`bench/moe_row.py`, 48 chained MoE halves in a graph), then the two fastest in the step
#      against the default and part 4's tiers4-64to1k+o-aware64 at 1k-16k on 40,960-position caches; on an H200,
#      the context table with the winner if one beat the default (STRATA_MOE_SPLIT). H100 (h100_session39/split/):
#      every tile slower (MoE half 34.7 us shipped, 38.6 best), the sum of the partials 11 us a layer; the tiles
#      named now store the partials by column blocks so the sum reads whole sectors (CB; 5 us a layer instead of 11
#      on an H100), keep them in L2 (EVL) or sum them in the last programs of one launch (TAIL).
#   6. On an H200: the open choices side by side in one run (the default, the split experts' two best H100 tiles,
#      o-aware64, tiers4-64to1k and both, at 1k / 4k / 16k on 40,960-position caches), then the context table with
#      the defaults, and with the fastest split tile too if it beat the default (H100: s16p3ecr8w8 3.05 / 3.06 /
#      3.60 ms against 3.03 / 3.04 / 3.56, a wash: h100_session40/).
#   7. The one-row chunks of the row's own length (runtime/kv.py ONE_ROW_CHUNKS, default since this part was
#      written): the context table with the defaults (the goal figures; context_table.json), then
#      `bench/context.py --check` (row invariance, greedy speculative = target alone, on this GPU), then the step
#      before (one-row-tiers: KV_TIERS for one row too) against the default, the step's inputs through torch's
#      six launches (inputs-torch: static_step.STEP_INPUTS off) and another layout (ad64) at 1k-32k on
#      40,960-position caches. H100 (bench/results/h100_session41/): 3.03 / 3.04 / 3.56 / 4.13 -> 2.92 / 3.02 /
#      3.49-3.51 / 4.06 ms at 1k / 4k / 16k / 32k.
#   8. A one-row window over a q8_0 cache with the chunks of its row's length too (runtime/kv.py ONE_ROW_CHUNKS_Q8,
#      off: the tiers), layouts with more chunks than the BF16 one's (arms q8ad96, q8ad128, q8ad256), at 1k-32k on
#      40,960-position caches and at 128k on a 131,136-position one. H100 before (h100_session41/part7/): the q8_0
#      one-row step at 67 / 66 / 63 / 59 / 54% of its bound at 1k / 4k / 16k / 32k / 128k. H100
#      (h100_session42/part8/): the arms 1-2% faster up to 4k, 1-3% slower at 16k-131k; an H200 may differ.
#   goal. With little device time left (about 6 minutes): part 7 without its GPU checks (an H100 ran them with the
#      same kernels, h100_session43/check/): the context table with the 8192-token prefill chunk too (what the wizard
#      picks when every expert is resident), then the one-row layout against the tiers at 1k-32k. H100
#      (h100_session44/table/): BF16 decode 69 / 70 / 72 / 75 / 87% of the bound at 1k / 4k / 16k / 32k / 128k (W=1).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
part=${1:-1}
if [ "$part" = 1 ]; then
  echo "--- the graphed one-row step's timeline ($(( $(date +%s) - start )) s)"
  timeout 150 python3 bench/step_timeline.py --contexts 1024,16384 --capacity 32768 > "$OUT/timeline.log" 2>&1
  tail -32 "$OUT/timeline.log"
  echo "--- context table ($(( $(date +%s) - start )) s)"
  timeout 200 python3 bench/context.py --no-hf --prefill 8192 --extra-chunks 8192 --capacity 40960 \
    > "$OUT/context.log" 2>&1; tail -16 "$OUT/context.log"
  echo "--- one-row q8_0 tile ($(( $(date +%s) - start )) s)"
  timeout 200 python3 bench/step_ab.py --kv q8_0 --contexts 1024,32768,131072 --widths 1 \
    --arms default,rt1-64,q8-one-nocap --rounds 5 > "$OUT/step_ab_q8_one.log" 2>&1
  mv "$OUT/step_ab.json" "$OUT/step_ab_q8_one.json"; tail -12 "$OUT/step_ab_q8_one.log"
elif [ "$part" = 3 ]; then
  echo "--- the split kernel's KV asked into L2 before its wait: arms ($(( $(date +%s) - start )) s)"
  timeout 300 python3 bench/step_ab.py --contexts 1024,4096,16384,32768 --widths 1 --capacity 40960 \
    --arms o-lean,default,o-aware,trig-split,tiers-64to4k --rounds 7 \
    > "$OUT/step_ab_kv_pf.log" 2>&1
  mv "$OUT/step_ab.json" "$OUT/step_ab_kv_pf.json"; grep -v "━" "$OUT/step_ab_kv_pf.log" | tail -26
  echo "--- its timeline ($(( $(date +%s) - start )) s)"
  timeout 100 python3 bench/step_timeline.py --contexts 1024,16384 --capacity 40960 --arm "${2:-default}" \
    > "$OUT/timeline_kv_pf.log" 2>&1
  mv "$OUT/step_timeline.json" "$OUT/step_timeline_kv_pf.json"; grep -v "━" "$OUT/timeline_kv_pf.log" | tail -30
elif [ "$part" = 4 ]; then
  echo "--- short-context arms ($(( $(date +%s) - start )) s)"
  timeout 240 python3 bench/step_ab.py --contexts 1024,2048,4096,16384 --widths 1 --capacity 40960 \
    --arms default,o-aware,o-aware32,o-aware64,tiers4-64to1k,tiers4-64to2k,tiers4-64to1k+o-aware64 --rounds 7 \
    > "$OUT/step_ab_short.log" 2>&1
  mv "$OUT/step_ab.json" "$OUT/step_ab_short.json"; grep -v "━" "$OUT/step_ab_short.log" | tail -32
  if grep -q H200 "$OUT/gpu.txt" && [ "${2:-}" != arms-only ]; then
    echo "--- context table ($(( $(date +%s) - start )) s)"
    timeout 200 python3 bench/context.py --no-hf --prefill 8192 --extra-chunks 8192 --capacity 40960 \
      > "$OUT/context.log" 2>&1; tail -16 "$OUT/context.log"
  fi
elif [ "$part" = 5 ]; then
  echo "--- the one-row experts split over the intermediate, alone ($(( $(date +%s) - start )) s)"
  timeout 150 python3 bench/moe_row.py --max-seconds 120 \
    --only ffn-s16p3,ffn-s16p3cr4w8,ffn-s16p3cr8w8,ffn-s16p3ecr4w8,ffn-s16p3ecr8w8,ffn-s16p3ect128,ffn-s16p3ect256 > "$OUT/moe_split.log" 2>&1
  mv "$OUT/moe_row_bf16.json" "$OUT/moe_split.json"; grep -v "━" "$OUT/moe_split.log" | tail -16
  best=$(python3 -c "import json; r = [x for x in json.load(open('$OUT/moe_split.json'))['rows'] if 'us' in x and
x['method'].startswith('ffn-')]; r.sort(key=lambda x: x['us']); print(','.join(x['method'] for x in r[:2]))")
  echo "--- in the step: default, ${best:-none}, and part 4's marks ($(( $(date +%s) - start )) s)"
  timeout 300 python3 bench/step_ab.py --contexts 1024,4096,16384 --widths 1 --capacity 40960 \
    --arms "default${best:+,$best},tiers4-64to1k+o-aware64" --rounds 5 > "$OUT/step_ab_ffn.log" 2>&1
  mv "$OUT/step_ab.json" "$OUT/step_ab_ffn.json"; grep -v "━" "$OUT/step_ab_ffn.log" | tail -26
  win=$(python3 -c "import json; r = json.load(open('$OUT/step_ab_ffn.json'))['rows']
ms = lambda a: sum(x.get('step_ms', 0) for x in r if x['arm'] == a) or 1e9
b = min((a for a in {x['arm'] for x in r} if a.startswith('ffn-')), key=ms, default='')
print(b[4:] if b and ms(b) < ms('default') else '')" 2>/dev/null)
  if grep -q H200 "$OUT/gpu.txt" && [ -n "$win" ] && [ $(( $(date +%s) - start )) -lt 330 ]; then
    echo "--- context table with the experts split (tile $win) ($(( $(date +%s) - start )) s)"
    STRATA_MOE_SPLIT=$win timeout 200 python3 bench/context.py --no-hf --prefill 8192 --extra-chunks 8192 \
      --capacity 40960 > "$OUT/context_ffn.log" 2>&1; tail -16 "$OUT/context_ffn.log"
  fi
elif [ "$part" = 6 ]; then
  echo "--- the open choices side by side ($(( $(date +%s) - start )) s)"
  timeout 200 python3 bench/step_ab.py --contexts 1024,4096,16384 --widths 1 --capacity 40960 --rounds 5 \
    --arms default,ffn-s16p3ecr8w8,ffn-s16p3ecr4w8,o-aware64,tiers4-64to1k,tiers4-64to1k+o-aware64 \
    > "$OUT/step_ab_open.log" 2>&1
  mv "$OUT/step_ab.json" "$OUT/step_ab_open.json"; grep -v "━" "$OUT/step_ab_open.log" | tail -24
  echo "--- context table, defaults ($(( $(date +%s) - start )) s)"
  timeout 180 python3 bench/context.py --no-hf --prefill 8192 --capacity 40960 > "$OUT/context.log" 2>&1
  cp "$OUT/context.json" "$OUT/context_default.json" 2>/dev/null; tail -16 "$OUT/context.log"
  win=$(python3 -c "import json; r = json.load(open('$OUT/step_ab_open.json'))['rows']
ms = lambda a: sum(x.get('step_ms', 0) for x in r if x['arm'] == a) or 1e9
b = min((a for a in {x['arm'] for x in r} if a.startswith('ffn-')), key=ms, default='')
print(b[4:] if b and ms(b) < ms('default') else '')" 2>/dev/null)
  if [ -n "$win" ] && [ $(( $(date +%s) - start )) -lt 400 ]; then
    echo "--- context table with the experts split (tile $win) ($(( $(date +%s) - start )) s)"
    STRATA_MOE_SPLIT=$win timeout 180 python3 bench/context.py --no-hf --prefill 8192 --capacity 40960 \
      > "$OUT/context_ffn.log" 2>&1; tail -16 "$OUT/context_ffn.log"
  fi
elif [ "$part" = 7 ]; then
  echo "--- context table, defaults ($(( $(date +%s) - start )) s)"
  timeout 200 python3 bench/context.py --no-hf --prefill 8192 --capacity 40960 > "$OUT/context.log" 2>&1
  mv "$OUT/context.json" "$OUT/context_table.json" 2>/dev/null; tail -16 "$OUT/context.log"
  echo "--- checks on the GPU ($(( $(date +%s) - start )) s)"
  timeout 200 python3 bench/context.py --check > "$OUT/check.log" 2>&1; echo "rc=$?"
  mv "$OUT/context.json" "$OUT/check.json" 2>/dev/null; grep -E "^ *(ok|FAIL)" "$OUT/check.log" | cut -c1-200
  echo "--- one-row chunk layouts ($(( $(date +%s) - start )) s)"
  timeout 170 python3 bench/step_ab.py --contexts 1024,4096,16384,32768 --widths 1 --capacity 40960 --rounds 5 \
    --arms one-row-tiers,default,inputs-torch,ad64 > "$OUT/step_ab_one_row.log" 2>&1
  mv "$OUT/step_ab.json" "$OUT/step_ab_one_row.json"; grep -v "━" "$OUT/step_ab_one_row.log" | tail -20
elif [ "$part" = goal ]; then
  echo "--- context table, defaults ($(( $(date +%s) - start )) s)"
  timeout 230 python3 bench/context.py --no-hf --prefill 8192 --extra-chunks 8192 --capacity 40960 \
    > "$OUT/context.log" 2>&1
  mv "$OUT/context.json" "$OUT/context_table.json" 2>/dev/null; grep -E "^  (decode|prefill)" "$OUT/context.log"
  echo "--- one-row chunk layout against the tiers ($(( $(date +%s) - start )) s)"
  timeout 150 python3 bench/step_ab.py --contexts 1024,4096,16384,32768 --widths 1 --capacity 40960 --rounds 5 \
    --arms one-row-tiers,default > "$OUT/step_ab_one_row.log" 2>&1
  mv "$OUT/step_ab.json" "$OUT/step_ab_one_row.json"; grep -v "━" "$OUT/step_ab_one_row.log" | tail -14
elif [ "$part" = 8 ]; then
  echo "--- one-row layouts over a q8_0 cache ($(( $(date +%s) - start )) s)"
  timeout 200 python3 bench/step_ab.py --kv q8_0 --contexts 1024,4096,16384,32768 --widths 1 --capacity 40960 \
    --rounds 5 --arms default,q8ad96,q8ad128,q8ad256 > "$OUT/step_ab_q8_one_row.log" 2>&1
  mv "$OUT/step_ab.json" "$OUT/step_ab_q8_one_row.json"; grep -v "━" "$OUT/step_ab_q8_one_row.log" | tail -20
  timeout 150 python3 bench/step_ab.py --kv q8_0 --contexts 131072 --widths 1 --rounds 5 \
    --arms default,q8ad96,q8ad128,q8ad256 > "$OUT/step_ab_q8_one_row_131k.log" 2>&1
  mv "$OUT/step_ab.json" "$OUT/step_ab_q8_one_row_131k.json"; grep -v "━" "$OUT/step_ab_q8_one_row_131k.log" | tail -8
else
  echo "--- q8_0 windows of 8 rows ($(( $(date +%s) - start )) s)"
  timeout 200 python3 bench/step_ab.py --kv q8_0 --contexts 32768,131072 --widths 8 \
    --arms wide-default,q8-wide32,q8-wide16 --rounds 5 > "$OUT/step_ab_q8_wide.log" 2>&1
  mv "$OUT/step_ab.json" "$OUT/step_ab_q8_wide.json"; tail -10 "$OUT/step_ab_q8_wide.log"
  echo "--- Q4_K targets ($(( $(date +%s) - start )) s)"
  timeout 200 python3 bench/quant_target.py --device cuda --part speed --quants q4_k,q4_k_m > "$OUT/quant_k.log" 2>&1
  tail -12 "$OUT/quant_k.log"
fi
echo "--- done in $(( $(date +%s) - start )) s"
