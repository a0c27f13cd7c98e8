#!/usr/bin/env bash
# GPU calls: our server at an earlier commit ("before", its mlx_relay package unpacked in
# BEFORE_SRC, default .device-carry/before) and at a later one ("ours": AFTER_SRC, default this
# checkout) side by side on one GPU,
# each capped with MLX's process memory and buffer-cache limits, measured by ONE harness run that
# alternates between them wave by wave (machine drift cancels).
#   bash benchmarks/gpu/device_before_after.sh start            # boot both (detached), wait, warm
#   bash benchmarks/gpu/device_before_after.sh run SCENARIO "LEVELS:REQUESTS" ...   # measure
# The servers outlive the `start` call (setsid), so boot and measurement fit the 600 s call limit.
# Unpack each side once here:
#   git archive COMMIT mlx_relay | tar -x -C .device-carry/before --exclude 'mlx_relay/models/*'
# (the served model is built on the GPU machine; the embedded tiny model is not needed there).
source benchmarks/gpu/device_env.sh
MEM_GB=${MEM_GB:-62}; CACHE_GB=${CACHE_GB:-4}; PREFIX_GB=${PREFIX_GB:-6}
before=${BEFORE_SRC:-$PWD/.device-carry/before}
after=${AFTER_SRC:-$PWD}  # a package unpacked from `git archive`: the working tree may change between calls
flags=(--served-model-name qwen35-moe --max-num-seqs 64 --max-queue 512 --memory-limit-gb "$MEM_GB"
       --cache-limit-gb "$CACHE_GB" --prefix-cache-gb "$PREFIX_GB" ${OURS_FLAGS:-})
targets=(--target before=http://127.0.0.1:8001 --target ours=http://127.0.0.1:8000)
ready() {  # url
  python3 - "$1" <<'PY' 2>/dev/null
import sys, httpx
sys.exit(0 if httpx.get(sys.argv[1], timeout=2).status_code == 200 else 1)
PY
}
t0=$(date +%s)
if [ "$1" = start ]; then
  PYTHONPATH="$before:/tmp/site" setsid nohup python3 -m mlx_relay.cli serve "$MODEL" --port 8001 "${flags[@]}" \
    > /root/before.log 2>&1 < /dev/null &
  PYTHONPATH="$after:/tmp/site" setsid nohup python3 -m mlx_relay.cli serve "$MODEL" --port 8000 "${flags[@]}" \
    > /root/ours.log 2>&1 < /dev/null &
  for _ in $(seq 1 520); do
    ready http://127.0.0.1:8000/health && ready http://127.0.0.1:8001/health && break
    sleep 1
  done
  echo "both ready after $(( $(date +%s) - t0 ))s"
  warm=${WARM:-64:32}
  PYTHONPATH="$after:/tmp/site" timeout -k 5 "${WARM_S:-200}" python3 -m mlx_relay.cli bench "${targets[@]}" --scenario short_chat \
    --concurrency "${warm%%:*}" --requests "${warm##*:}" --no-plots --out /tmp/warm --seed 99 > /dev/null || true
  echo "warm after $(( $(date +%s) - t0 ))s"
  exit 0
fi
scenario=$2; shift 2
i=0
for spec in "$@"; do
  levels=${spec%%:*}; n=${spec##*:}; i=$((i + 1))
  PYTHONPATH="$after:/tmp/site" python3 -m mlx_relay.cli bench "${targets[@]}" --scenario "$scenario" --concurrency "$levels" \
    --requests "$n" --no-plots --out "/tmp/ba-$i" --duration 400 | grep "^|" || true
  cp "/tmp/ba-$i/bench.json" "$OUT/${scenario}-before-after-$i.json"
  echo "run $i done after $(( $(date +%s) - t0 ))s"
done
echo "out-of-memory lines: before $(grep -c "out of memory" /root/before.log || true)," \
  "ours $(grep -c "out of memory" /root/ours.log || true)"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
