#!/usr/bin/env bash
# GPU call: our server and mlx_vlm.server side by side on one GPU (each capped with MLX's
# process memory and buffer-cache limits so both fit), warmed, then ONE harness run against both
# targets: the harness alternates between them (ABBA per wave), so machine drift cancels.
#   MEM_GB=60 CACHE_GB=4 bash benchmarks/gpu/device_alternating.sh SCENARIO "LEVELS:REQUESTS" [...]
source benchmarks/gpu/device_env.sh
scenario=$1; shift
MEM_GB=${MEM_GB:-60}; CACHE_GB=${CACHE_GB:-4}
t0=$(date +%s)
PYTHONPATH="${OURS_SRC:-$PWD}:/tmp/site" python3 -m mlx_relay.cli serve "$MODEL" --port 8000 --served-model-name qwen35-moe --max-num-seqs 64 \
  --max-queue 512 --memory-limit-gb "$MEM_GB" --cache-limit-gb "$CACHE_GB" ${OURS_FLAGS:-} > /tmp/ours.log 2>&1 &
ours=$!
# the peer with its prefix cache (APC) on unless PEER_APC=0: both servers reuse prefixes
APC_ENABLED=${PEER_APC:-1} APC_DISK_ENABLED=0 python3 benchmarks/gpu/mlx_vlm_server_capped.py "$MEM_GB" "$CACHE_GB" \
  -- --model "$MODEL" --host 127.0.0.1 --port 8001 --max-num-seqs 64 > /tmp/mlx_vlm.log 2>&1 &
peer=$!
trap 'kill $ours $peer 2>/dev/null || true' EXIT
ready() {  # url
  python3 - "$1" <<'PY' 2>/dev/null
import sys, httpx
sys.exit(0 if httpx.get(sys.argv[1], timeout=2).status_code == 200 else 1)
PY
}
for _ in $(seq 1 500); do
  ready http://127.0.0.1:8000/health && ready http://127.0.0.1:8001/v1/models && break
  kill -0 $ours 2>/dev/null || { tail -20 /tmp/ours.log; exit 1; }
  kill -0 $peer 2>/dev/null || { tail -20 /tmp/mlx_vlm.log; exit 1; }
  sleep 1
done
echo "both ready after $(( $(date +%s) - t0 ))s"
targets=(--target ours=http://127.0.0.1:8000 --target mlx_vlm=http://127.0.0.1:8001)
warm=${WARM:-64:64}
python3 -m mlx_relay.cli bench "${targets[@]}" --scenario "$scenario" --concurrency "${warm%%:*}" \
  --requests "${warm##*:}" --no-plots --out /tmp/warm --seed 99 > /dev/null || true
echo "warm after $(( $(date +%s) - t0 ))s"
i=0
for spec in "$@"; do
  levels=${spec%%:*}; n=${spec##*:}; i=$((i + 1))
  python3 -m mlx_relay.cli bench "${targets[@]}" --scenario "$scenario" --concurrency "$levels" \
    --requests "$n" --no-plots --out "/tmp/alt-$i" --duration 400 | grep "^|" || true
  cp "/tmp/alt-$i/bench.json" "$OUT/${scenario}-alternating-$i.json"
  echo "run $i done after $(( $(date +%s) - t0 ))s"
done
echo "out-of-memory lines: ours $(grep -c "out of memory" /tmp/ours.log || true)," \
  "mlx_vlm $(grep -c "out of memory" /tmp/mlx_vlm.log || true)"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
