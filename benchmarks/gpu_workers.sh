#!/usr/bin/env bash
# Localization on GPU workers end to end, beside the API running the model itself, in one go:
#   QLOC_DEVICE=cuda bash benchmarks/gpu_workers.sh [OUT_DIR]
# Starts a Redis (REDIS_SERVER, default redis-server on PATH; port REDIS_PORT, default 6390), one localize
# worker (Celery, the localize queue, 8 threads, on QLOC_DEVICE), an API in workers mode (no model; port 8021)
# and an API in local mode (the model in the API, on QLOC_DEVICE; port 8022), all on one fresh SQLite database
# and blob folder; then benchmarks/service_localize.py against each: CorLoc of 500 digit-4 test images,
# latency at 1 and 32 images per request, images/s at 1 and 4 clients. Results: OUT_DIR/{local,workers}.json,
# the processes' logs beside them. The same commands run on a CPU machine (QLOC_DEVICE=cpu).
set -uo pipefail
out=${1:-runs/gpu-workers}
mkdir -p "$out"
out=$(cd "$out" && pwd)
var=$(mktemp -d)
port=${REDIS_PORT:-6390}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} QLOC_LOG_LEVEL=WARNING \
  QLOC_DATABASE_URL="sqlite:///$var/qloc.db" QLOC_STORAGE_DIR="$var/blobs" \
  QLOC_BROKER_URL="redis://127.0.0.1:$port/0" QLOC_RESULT_BACKEND="redis://127.0.0.1:$port/0" \
  QLOC_DEVICE=${QLOC_DEVICE:-auto}
py=${PYTHON:-python3}
pids=()
stop() { kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null; }
trap stop EXIT

"${REDIS_SERVER:-redis-server}" --port "$port" --save '' --appendonly no --dir "$var" > "$out/redis.log" 2>&1 &
pids+=($!)
"$py" -m alembic upgrade head > "$out/migrate.log" 2>&1 || { cat "$out/migrate.log"; exit 1; }
"$py" -m celery -A worker.celery_app worker -Q qloc-localize --pool threads --concurrency 8 --loglevel WARNING \
  --without-mingle --without-gossip > "$out/worker.log" 2>&1 &
pids+=($!)
QLOC_INFERENCE=workers "$py" -m uvicorn --factory app.main:create_app --port 8021 > "$out/api-workers.log" 2>&1 &
pids+=($!)
QLOC_INFERENCE=local "$py" -m uvicorn --factory app.main:create_app --port 8022 > "$out/api-local.log" 2>&1 &
pids+=($!)
for p in 8021 8022; do
  for _ in $(seq 120); do
    "$py" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$p/readyz').status_code != 200)" 2>/dev/null \
      && break
    sleep 1
  done
done
rc=0
for mode in local workers; do
  url=http://127.0.0.1:$([ $mode = local ] && echo 8022 || echo 8021)
  "$py" benchmarks/service_localize.py --url "$url" --requests 30 --clients 1 4 --seconds "${SECONDS_EACH:-8}" \
    --out "$out/$mode.json" > "$out/$mode.log" 2>&1 || { rc=1; tail -20 "$out/$mode.log"; }
done
exit $rc
