#!/usr/bin/env bash
# The CUDA tests, and guarded adaptation with reward repair, on a GPU machine (its own python3 with torch, no
# venv); every suite and seed in parallel (one process each), each stopped after $BUDGET seconds (470):
#   bash benchmarks/gpu_repair.sh [OUT_DIR]
# Needs, carried from the development machine (both ignored by git, e.g. in .git/info/exclude):
#   .whl1/   cp312 wheels of pydantic, pydantic-core, pydantic-settings, typing-inspection, annotated-types and
#            python-dotenv (the settings object), from `pip download --no-deps --only-binary=:all:
#            --python-version 3.12 --platform manylinux2014_x86_64 -d .whl1 NAME==VERSION` (the venv's versions);
#   .fonts/  `cp -r /usr/share/fonts .fonts`: the glyph kinds render from the same fonts, so the same splits.
set -uo pipefail
out=${1:-${OUT:-runs/gpu-repair}}
mkdir -p "$out/r"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl1/*.whl
rm -rf /usr/share/fonts && cp -r .fonts /usr/share/fonts
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/r/gpu.txt"
python3 -c "import torch; print(torch.__version__)" >> "$out/r/gpu.txt"
timeout "${BUDGET:-470}" python3 -m pytest -q -ra -p no:cacheprovider tests/models/test_cuda.py \
  > "$out/r/test_cuda.txt" 2>&1 &
for suite in glyphs digits backgrounds; do
  for seed in 0 1 2; do
    timeout "${BUDGET:-470}" python3 benchmarks/guarded_adaptation.py --suite "$suite" --seeds "$seed" --repair \
      --device cuda > "$out/r/$suite-$seed.json" 2> "$out/r/$suite-$seed.err" &
  done
done
wait
tar -C "$out" -czf "$out/repair.tgz" r
