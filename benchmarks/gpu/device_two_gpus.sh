#!/usr/bin/env bash
# Two GPUs of one host (issue 35), one job after another in the background (a device call lasts 10
# minutes at most), collected like device_steps.sh:
#   JOBS="pipe tp cluster failover" bash benchmarks/gpu/device_two_gpus.sh start   # builds the model if needed
#   bash benchmarks/gpu/device_two_gpus.sh wait 560                                  # copies what is done to $OUT/two
# Jobs (results in $OUT/two/):
#   pipe      one server on GPU 0 and the same model as a pipeline over both GPUs (mlx.launch, NCCL), side by
#             side, the same flags (SERVE_FLAGS): pipeline_identity.py (greedy replies: alone with MTP, two
#             at once, a prefix-cache hit), device memory per process (nvidia-smi), then mlx-relay bench
#             short_chat c=1 and c=16 against both in alternating waves; then bench_pipeline_transfer.py over
#             the two GPUs (the collectives a step adds, alone)
#   tp        bench_tensor_parallel.py: mlx-lm's batch-1 decode on GPU 0, then sharded (Model.shard) over both
#   cluster   mlx-relay cluster, one replica per GPU (--replica-devices 0,1) behind SMG: agent_fleet at c=32
#             (FLEET_REQUESTS) against replica 1 alone (seed 1), then through the router (seed 2);
#             session_affinity.py on the router's run; requests per replica from their /metrics
#   failover  (after cluster, same cluster) cluster_failover.py: replica 2 SIGKILLed with every session
#             streaming (FAILOVER_SESSIONS)
# LOCAL=1 MODEL=DIR RUN=DIR OUT=DIR BACKEND=ring: a dry run off the device.
RUN=${RUN:-/root/two}
if [ "${1:-start}" = wait ]; then
  for _ in $(seq 1 "${2:-560}"); do [ -f $RUN/done ] && break; sleep 1; done
  mkdir -p "$OUT/two" && cp -r $RUN/out/. "$OUT/two/" 2>/dev/null || true
  tail -n 6 $RUN/progress.txt 2>/dev/null; [ -f $RUN/done ] && echo "two done"
  exit 0
fi
if [ "${LOCAL:-0}" = 1 ]; then set -euo pipefail; else source benchmarks/gpu/device_env.sh; fi
mkdir -p $RUN/out $RUN/src && cp -r mlx_relay benchmarks $RUN/src/
if [ ! -f "$MODEL/config.json" ]; then
  python3 benchmarks/gpu/build_random_model.py "$MODEL" --tokenizer /root/tok 2>&1 | tail -2
fi
cat > $RUN/run.sh <<'EOS'
set -uo pipefail
O=$RUN/out; t0=$(date +%s)
say() { echo "$(( $(date +%s) - t0 ))s $*" | tee -a $RUN/progress.txt; }
launch() { python3 -c "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; main()" "$@"; }
get() {  # url: its body on stdout; status 0 on a 200
  python3 -c "import sys, httpx; r = httpx.get(sys.argv[1], timeout=10); print(r.text); sys.exit(r.status_code != 200)" \
    "$1" 2>/dev/null
}
ready() {  # url: 0 once it answers 200 (900 s at most)
  for _ in $(seq 1 900); do get "$1/health" > /dev/null && return 0; sleep 1; done; return 1
}
gpu_memory() {  # label: device memory per process and per GPU
  { echo "== $1"; nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv 2>/dev/null
    nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv 2>/dev/null
    nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>/dev/null
    ps -eo pid,args | grep "[m]lx_relay" | cut -c1-200; } >> $O/gpu_memory.txt
}
stop_all() { pkill -TERM -f "mlx_relay.cli" 2>/dev/null; sleep 8; pkill -KILL -f "mlx_relay.cli" 2>/dev/null; pkill -KILL -f "smg" 2>/dev/null; sleep 2; }
FLAGS="--served-model-name m --prefix-cache-gb 4 --cache-limit-gb 4 --log-level warning $SERVE_FLAGS"
for job in $JOBS; do case $job in
pipe)
  CUDA_VISIBLE_DEVICES=0 python3 -m mlx_relay.cli serve "$MODEL" --port 8100 $FLAGS > $O/one.log 2>&1 &
  launch -n 2 --backend "$BACKEND" --python python3 -- -m mlx_relay.cli serve "$MODEL" --pipeline --port 8101 \
    $FLAGS > $O/pipe.log 2>&1 &
  if ready http://127.0.0.1:8100 && ready http://127.0.0.1:8101; then
    say "pipe: both ready"
    gpu_memory "idle, after warm-up"
    python3 benchmarks/pipeline_identity.py http://127.0.0.1:8100 http://127.0.0.1:8101 --out $O/identity.json \
      > $O/identity.txt 2>&1; say "identity (rc $?): $(tr '\n' ' ' < $O/identity.txt | cut -c1-300)"
    python3 -m mlx_relay.cli bench --target one=http://127.0.0.1:8100 --target pipe=http://127.0.0.1:8101 \
      --scenario short_chat --concurrency 1 --requests "${C1_REQUESTS:-16}" --wave 4 --warmup 2 \
      --out $O/short_c1 > $O/short_c1.txt 2>&1; say "short c=1 (rc $?)"
    python3 -m mlx_relay.cli bench --target one=http://127.0.0.1:8100 --target pipe=http://127.0.0.1:8101 \
      --scenario short_chat --concurrency 16 --requests "${C16_REQUESTS:-64}" --wave 32 --warmup 16 \
      --out $O/short_c16 > $O/short_c16.txt 2>&1; say "short c=16 (rc $?)"
    gpu_memory "after c=16"
    for u in 8100 8101; do get http://127.0.0.1:$u/v1/models > $O/models_$u.json; done
  else
    say "pipe: a server did not get ready: $(tail -n 3 $O/one.log $O/pipe.log | tr '\n' ' ' | cut -c1-600)"
  fi
  stop_all
  launch -n 2 --backend "$BACKEND" --python python3 -- benchmarks/bench_pipeline_transfer.py \
    --iters "${TRANSFER_ITERS:-200}" --out $O/transfer.json > $O/transfer.txt 2>&1
  say "transfer (rc $?): $(tr '\n' ' ' < $O/transfer.txt | cut -c1-400)" ;;
tp)
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_tensor_parallel.py "$MODEL" --out $O/tp1.json $TP_FLAGS \
    > $O/tp1.txt 2>&1; say "tp 1 GPU (rc $?): $(tail -n 2 $O/tp1.txt | tr '\n' ' ')"
  launch -n 2 --backend "$BACKEND" --python python3 -- benchmarks/bench_tensor_parallel.py "$MODEL" \
    --out $O/tp2.json --compare $O/tp1.json $TP_FLAGS > $O/tp2.txt 2>&1
  say "tp 2 GPUs (rc $?): $(tail -n 3 $O/tp2.txt | tr '\n' ' ')" ;;
cluster)
  python3 -m mlx_relay.cli cluster "$MODEL" --replicas 2 --replica-devices 0,1 --port 8200 $FLAGS \
    > $O/cluster.log 2>&1 &
  for _ in $(seq 1 1800); do grep -q "cluster ready" $O/cluster.log && break; sleep 0.5; done
  if grep -q "cluster ready" $O/cluster.log; then
    say "cluster ready: $(grep -h 'ready on GPU' $O/cluster.log | tr '\n' ' ')"
    gpu_memory "cluster idle"
    python3 -m mlx_relay.cli bench --target one=http://127.0.0.1:8201 --scenario "${FLEET_SCENARIO:-agent_fleet}" --seed 1 \
      --concurrency 32 --requests "${FLEET_REQUESTS:-128}" --warmup 2 --out $O/fleet_one > $O/fleet_one.txt 2>&1
    say "fleet one replica (rc $?)"
    for u in 8201 8202; do get http://127.0.0.1:$u/metrics | grep -E "^mlx_relay:(request_success_total|prompt_tokens_total)" \
      | sed "s/^/$u /" >> $O/fleet_replicas.txt; done
    python3 -m mlx_relay.cli bench --target two=http://127.0.0.1:8200 --scenario "${FLEET_SCENARIO:-agent_fleet}" --seed 2 \
      --concurrency 32 --requests "${FLEET_REQUESTS:-128}" --warmup 2 --out $O/fleet_two > $O/fleet_two.txt 2>&1
    say "fleet two replicas (rc $?)"
    for u in 8201 8202; do get http://127.0.0.1:$u/metrics | grep -E "^mlx_relay:(request_success_total|prompt_tokens_total)" \
      | sed "s/^/$u after /" >> $O/fleet_replicas.txt; done
    python3 benchmarks/session_affinity.py $O/fleet_two/bench.json > $O/fleet_affinity.txt 2>&1
    python3 benchmarks/session_affinity.py $O/fleet_one/bench.json >> $O/fleet_affinity.txt 2>&1
    say "affinity: $(tr '\n' ' ' < $O/fleet_affinity.txt)"
    gpu_memory "cluster after fleet"
  else
    say "cluster not ready: $(tail -n 5 $O/cluster.log | tr '\n' ' ' | cut -c1-600)"
  fi ;;
failover)
  if grep -q "cluster ready" $O/cluster.log 2>/dev/null; then
    victim=$(grep -h "replica 2 pid=" $O/cluster.log | head -1 | sed 's/.*pid=\([0-9]*\).*/\1/')
    python3 benchmarks/cluster_failover.py http://127.0.0.1:8200 --replica http://127.0.0.1:8201 \
      --replica http://127.0.0.1:8202 --victim-pid "$victim" --sessions "${FAILOVER_SESSIONS:-12}" \
      --out $O/failover.json > $O/failover.txt 2>&1
    say "failover (rc $?): $(grep -E '"ok"|victim_|survivor_|hung' $O/failover.txt | tr -s ' \n' ' ')"
    grep -E "exited|stream" $O/cluster.log | tail -n 5 >> $O/failover.txt
  else
    say "failover: no cluster"
  fi
  stop_all ;;
*) say "unknown job $job" ;;
esac; done
stop_all
touch $RUN/done
EOS
rm -f $RUN/done $RUN/progress.txt
cd $RUN/src
setsid nohup env RUN="$RUN" MODEL="${MODEL:-}" PYTHONPATH="$RUN/src:${PYTHONPATH:-}" JOBS="${JOBS:-pipe tp cluster failover}" \
  LOCAL="${LOCAL:-0}" BACKEND="${BACKEND:-nccl}" SERVE_FLAGS="${SERVE_FLAGS:-}" TP_FLAGS="${TP_FLAGS:-}" \
  FLEET_SCENARIO="${FLEET_SCENARIO:-}" C1_REQUESTS="${C1_REQUESTS:-}" C16_REQUESTS="${C16_REQUESTS:-}" FLEET_REQUESTS="${FLEET_REQUESTS:-}" \
  FAILOVER_SESSIONS="${FAILOVER_SESSIONS:-}" TRANSFER_ITERS="${TRANSFER_ITERS:-}" \
  bash $RUN/run.sh > $RUN/run.log 2>&1 &
echo "two started (pid $!)"
