#!/usr/bin/env bash
# GPU call: start our server and mlx_vlm.server on the same model, warm both, then run the
# harness against both (alternating waves) for one scenario. Usage:
#   bash benchmarks/gpu/device_serving.sh SCENARIO "LEVELS:REQUESTS" ["LEVELS:REQUESTS" ...]
# e.g. bash benchmarks/gpu/device_serving.sh short_chat "1,4:16" "16,64:64"
source benchmarks/gpu/device_env.sh
scenario=$1; shift
python3 -m mlx_relay.cli serve "$MODEL" --port 8000 --served-model-name qwen35-moe --max-num-seqs 64 \
  --max-queue 512 > /tmp/ours.log 2>&1 &
ours=$!
python3 -m mlx_vlm.server --model "$MODEL" --host 127.0.0.1 --port 8001 --max-num-seqs 64 \
  > /tmp/peer.log 2>&1 &
peer=$!
trap 'kill $ours $peer 2>/dev/null || true; cp /tmp/ours.log /tmp/peer.log "$OUT/" 2>/dev/null || true' EXIT
wait_ready() {  # url, seconds
  for _ in $(seq 1 "$2"); do
    if python3 - "$1" <<'PY' 2>/dev/null; then return 0; fi
import sys, httpx
r = httpx.get(sys.argv[1], timeout=2)
sys.exit(0 if r.status_code == 200 else 1)
PY
    sleep 1
  done
  echo "not ready: $1"; return 1
}
t0=$(date +%s)
wait_ready http://127.0.0.1:8000/health 400
wait_ready http://127.0.0.1:8001/v1/models 400
echo "both servers ready after $(( $(date +%s) - t0 ))s"
targets=(--target ours=http://127.0.0.1:8000 --target mlx_vlm=http://127.0.0.1:8001)
# Unmeasured pass at the largest level so every batch shape is compiled before timing.
python3 -m mlx_relay.cli bench "${targets[@]}" --scenario "$scenario" --concurrency 64 --requests 64 --no-plots \
  --out /tmp/warm --seed 99 > /dev/null
echo "warm pass done after $(( $(date +%s) - t0 ))s"
i=0
for spec in "$@"; do
  levels=${spec%%:*}; n=${spec##*:}; i=$((i + 1))
  python3 -m mlx_relay.cli bench "${targets[@]}" --scenario "$scenario" --concurrency "$levels" --requests "$n" \
    --no-plots --out "/tmp/run$i" --duration 500
  cp "/tmp/run$i/bench.json" "$OUT/${scenario}-$i.json"; cp "/tmp/run$i/bench.md" "$OUT/${scenario}-$i.md"
  echo "run $i done after $(( $(date +%s) - t0 ))s"
done
