#!/usr/bin/env bash
# The CUDA tests, and guarded adaptation with reward repair on a GPU machine (its own python3 with torch; no venv), every suite
# and seed in parallel (one process each):
#   bash benchmarks/gpu_repair.sh [OUT_DIR]
# Needs, carried from the development machine: .whl1/ (pydantic, pydantic-settings and what they need, as
# cp312 wheels: the settings object) and .fonts/ (a copy of /usr/share/fonts: the glyph kinds render from
# the same fonts, so the same font splits).
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
