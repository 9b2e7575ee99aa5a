#!/usr/bin/env bash
# One device call for the closing measurements: scripted setup on the GPU, calibration + exhaustive grid ,
# drafters , expert cache at half residency , budget vs measured peak .
# Carry .gpu_carry (wheels for gguf, platformdirs, questionary, prompt_toolkit, wcwidth, tomli_w), made here with
#   echo /.gpu_carry/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .gpu_carry \
#     gguf platformdirs questionary prompt_toolkit wcwidth tomli_w
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu_carry/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export STRATA_HOME=/tmp/strata-home
setup() { python3 -c 'import sys; from setup_wizard.cli import main; sys.argv[0] = "strata-setup"; main()' "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
start=$(date +%s)
setup --yes --drafter dflash2 --no-calibrate --config-out /tmp/dflash2.toml 2>&1 | tail -25 | tee "$OUT/setup.log"
setup budget --config /tmp/dflash2.toml 2>&1 | tail -20
echo "--- calibration + grid ($(( $(date +%s) - start )) s)"
timeout 230 python3 bench/calibration_grid.py --config /tmp/dflash2.toml --max-seconds 90 --grid-repeats 2 \
  --out "$OUT/calibration_grid.json" 2>&1 | tail -60 | tee "$OUT/calibration.log"
echo "--- drafters ($(( $(date +%s) - start )) s)"
timeout 100 python3 bench/drafters.py --max-seconds 80 --repeats 3 2>&1 | tail -25
echo "--- expert cache ($(( $(date +%s) - start )) s)"
timeout 50 python3 bench/expert_cache.py --repeats 2 2>&1 | tail -14
echo "--- budget ($(( $(date +%s) - start )) s)"
timeout 70 python3 bench/budget.py --max-seconds 60 --contexts 4096,32768,131072 2>&1 | tail -20
echo "--- done in $(( $(date +%s) - start )) s"
