#!/usr/bin/env bash
# The CUDA checks, run on a GPU machine in one go (its own python3 with torch; no venv):
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# 1. the CUDA tests, 2. the model tests on that machine's torch, 3. the speed benchmark on CUDA.
set -uo pipefail
out=${1:-${OUT:-runs/gpu}}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import sys, torch, torchvision; print(sys.version.split()[0], torch.__version__, torchvision.__version__)" \
  | tee -a "$out/gpu.txt"
python3 -m pytest -q -ra -p no:cacheprovider tests/models/test_cuda.py 2>&1 | tee "$out/test_cuda.txt"
timeout 240 python3 -m pytest -q -ra -x -p no:cacheprovider tests/models --deselect tests/models/test_cuda.py \
  -k "not photo_backbones" 2>&1 | tail -25 | tee "$out/test_models.txt"
python3 benchmarks/speed_mnist.py --device cuda --repeats 30 --batches 1 4 16 64 1024 2>&1 | tee "$out/speed_cuda.json"
