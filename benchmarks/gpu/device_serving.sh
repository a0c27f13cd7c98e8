#!/usr/bin/env bash
# GPU call: for each server in turn (ours, then mlx_vlm.server, on the same model and GPU),
# start it, warm it, run the harness for one scenario at the given levels, stop it.
# One server at a time: two 38 GB servers with their batch caches do not fit one GPU together
# (both ran out of memory at 64 sequences when tried). Usage:
#   bash benchmarks/gpu/device_serving.sh SCENARIO "LEVELS:REQUESTS" ["LEVELS:REQUESTS" ...]
source benchmarks/gpu/device_env.sh
scenario=$1; shift
SERVERS=${SERVERS:-"ours mlx_vlm"}
wait_ready() {  # url, seconds, pid
  for _ in $(seq 1 "$2"); do
    kill -0 "$3" 2>/dev/null || { echo "server $3 exited: see its log"; return 1; }
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
for name in $SERVERS; do
  if [ "$name" = raw ]; then  # the raw library loop: no server, the bench process drives mlx-vlm itself
    target=(--raw-loop "$MODEL")
  else
    if [ "$name" = ours ] || [ "$name" = before ]; then
      # OURS_FLAGS: e.g. --no-mtp (a random-weight head is never right: MTP would only cost).
      # "before": our server at an earlier commit, its mlx_relay package unpacked in BEFORE_SRC
      # (`git archive COMMIT mlx_relay | tar -x -C .device-carry/before --exclude 'mlx_relay/models/*'`)
      # OURS_SRC: our package unpacked from `git archive` (the working tree may change between calls)
      src=${OURS_SRC:-$PWD}; [ "$name" = before ] && src=${BEFORE_SRC:-$PWD/.device-carry/before}
      PYTHONPATH="$src:/tmp/site" python3 -m mlx_relay.cli serve "$MODEL" --port 8000 --served-model-name qwen35-moe \
        --max-num-seqs 64 --max-queue 512 ${OURS_FLAGS:-} > "/tmp/$name.log" 2>&1 &
      pid=$!; health=http://127.0.0.1:8000/health
    else
      python3 -m mlx_vlm.server --model "$MODEL" --host 127.0.0.1 --port 8000 --max-num-seqs 64 \
        > "/tmp/$name.log" 2>&1 &
      pid=$!; health=http://127.0.0.1:8000/v1/models
    fi
    wait_ready "$health" 400 "$pid" || { tail -20 "/tmp/$name.log"; kill $pid; continue; }
    echo "$name ready after $(( $(date +%s) - t0 ))s"
    target=(--target "$name=http://127.0.0.1:8000")
  fi
  # Unmeasured pass (WARM="LEVEL:REQUESTS", default the largest level) so batch shapes are compiled first.
  warm=${WARM:-64:64}
  python3 -m mlx_relay.cli bench "${target[@]}" --scenario "$scenario" \
    --concurrency "${warm%%:*}" --requests "${warm##*:}" --no-plots --out "/tmp/warm-$name" --seed 99 > /dev/null || true
  echo "$name warm after $(( $(date +%s) - t0 ))s"
  i=0
  for spec in "$@"; do
    levels=${spec%%:*}; n=${spec##*:}; i=$((i + 1))
    python3 -m mlx_relay.cli bench "${target[@]}" --scenario "$scenario" \
      --concurrency "$levels" --requests "$n" --no-plots --out "/tmp/$name-$i" --duration 400 | { grep "^| $name\|^| raw" || true; }
    cp "/tmp/$name-$i/bench.json" "$OUT/${scenario}-${name}-$i.json"
    echo "$name run $i done after $(( $(date +%s) - t0 ))s"
  done
  if [ "$name" != raw ]; then
    kill $pid; wait $pid 2>/dev/null || true
    echo "$name out-of-memory lines: $(grep -c "out of memory" "/tmp/$name.log" || true)"
  fi
done
