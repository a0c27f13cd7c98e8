#!/usr/bin/env bash
# Two GPUs of one host (issue 35), one job after another in the background (a device call lasts 10
# minutes at most), collected like device_steps.sh:
#   JOBS="pipe tp cluster failover" bash benchmarks/gpu/device_two_gpus.sh start   # builds the model if needed
#   bash benchmarks/gpu/device_two_gpus.sh wait 560                                  # copies what is done to $OUT/two
# Jobs (results in $OUT/two/):
#   pipe      one server on GPU 0 and the same model as a pipeline over RANKS GPUs (mlx.launch, NCCL), side by
#             side, the same flags (SERVE_FLAGS): pipeline_identity.py (greedy replies: alone with MTP, two
#             at once, a prefix-cache hit), device memory per process (nvidia-smi), then mlx-relay bench
#             short_chat c=1 and c=16 against both in alternating waves; then bench_pipeline_transfer.py over
#             the two GPUs (the collectives a step adds, alone)
#   tp        bench_tensor_parallel.py: mlx-lm's batch-1 decode on GPU 0, then sharded (Model.shard) over both
#   cluster   mlx-relay cluster, one replica per GPU (RANKS of them) behind SMG: agent_fleet at each of FLEET_LEVELS
#             (default 32; FLEET_REQUESTS) against replica 1 alone (seed 1), then through the router (seed 2);
#             session_affinity.py on the router's run, each missed session's replicas named from the replicas'
#             request lines (--log-level info); requests per replica from their /metrics
#   failover  (after cluster, same cluster) cluster_failover.py: replica 2 SIGKILLed with every session
#             streaming (FAILOVER_SESSIONS)
#   rankkill  (issue 46.4) the pipeline over RANKS GPUs, pipeline_rank_kill.py: rank 1 SIGKILLed with KILL_STREAMS (8)
#             streams in flight (each must end with an error event, /health 503, mlx.launch must exit), then
#             the same command relaunched: seconds to ready and one request answered
#   big       (issue 46.2) a larger shape (BIG_SHAPE 122b-a10b, BIG_BITS 8; build_random_model.py, layer by layer)
#             into BIG_DIR (default: a tmpfs of BIG_TMPFS_GB at /big, the shards past its room spilled to
#             /root/big-spill; the 35B model deleted first on the device), what one card would need against
#             each GPU's memory (big_fit.txt), then the pipeline over RANKS GPUs: seconds to ready, greedy
#             identity between two passes (pipeline_identity.py against itself), short_chat c=1 and c=16,
#             agent_sessions c=8, device memory per rank; with BIG_ONE=1 then a try on GPU 0 alone. The model
#             is deleted after (BIG_KEEP=1 keeps it).
# RANKS: the pipeline's ranks (default: every GPU; 2 off the device). SPECPREFILL=1: pipe's two servers
# also get a SpecPrefill draft (build_random_model.py --shape draft) and identity a 3,000-token case.
# LOCAL=1 MODEL=DIR RUN=DIR OUT=DIR BACKEND=ring: a dry run off the device (TOK=tokenizer dir,
# BUILD_FLAGS=--tiny for the draft and big builds).
RUN=${RUN:-/root/two}
if [ "${1:-start}" = wait ]; then
  for _ in $(seq 1 "${2:-560}"); do [ -f $RUN/done ] && break; sleep 1; done
  mkdir -p "$OUT/two" && cp -r $RUN/out/. "$OUT/two/" 2>/dev/null || true
  tail -n 6 $RUN/progress.txt 2>/dev/null; [ -f $RUN/done ] && echo "two done"
  exit 0
fi
if [ "${LOCAL:-0}" = 1 ]; then set -euo pipefail; else source benchmarks/gpu/device_env.sh; fi
mkdir -p $RUN/out $RUN/src && cp -r mlx_relay benchmarks $RUN/src/
case " ${JOBS:-pipe} " in *" pipe "*|*" tp "*|*" cluster "*|*" rankkill "*)  # (big builds its own)
  if [ ! -f "$MODEL/config.json" ]; then
    python3 benchmarks/gpu/build_random_model.py "$MODEL" --tokenizer /root/tok 2>&1 | tail -2
  fi ;;
esac
cat > $RUN/run.sh <<'EOS'
set -uo pipefail
# NVLink multicast stays off in every rank (the lending machines' rule; mlx.launch passes the environment on)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
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
if [ -z "${RANKS:-}" ]; then
  RANKS=$( { [ "$LOCAL" = 1 ] && echo 2; } || nvidia-smi -L 2>/dev/null | wc -l); [ "$RANKS" -ge 2 ] || RANKS=2
fi
rank_pid() {  # the pid of pipeline rank $1 (its environment says MLX_RANK)
  for p in $(pgrep -f "mlx_relay.cli serve" 2>/dev/null); do
    tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "MLX_RANK=$1" && { echo "$p"; return 0; }
  done; return 1
}
for job in $JOBS; do case $job in
pipe)
  spec=(); spec_case=()
  if [ "${SPECPREFILL:-0}" = 1 ]; then
    [ -f /root/draft/config.json ] || [ -f "$RUN/draft/config.json" ] || python3 benchmarks/gpu/build_random_model.py \
      "$RUN/draft" --tokenizer "$TOK" --shape draft $BUILD_FLAGS > $O/build_draft.txt 2>&1
    spec=(--specprefill-draft-model "$RUN/draft" --specprefill-threshold 2048); spec_case=(--specprefill-tokens 3000)
  fi
  CUDA_VISIBLE_DEVICES=0 python3 -m mlx_relay.cli serve "$MODEL" --port 8100 $FLAGS "${spec[@]}" > $O/one.log 2>&1 &
  launch -n "$RANKS" --backend "$BACKEND" --python python3 -- -m mlx_relay.cli serve "$MODEL" --pipeline --port 8101 \
    $FLAGS "${spec[@]}" > $O/pipe.log 2>&1 &
  if ready http://127.0.0.1:8100 && ready http://127.0.0.1:8101; then
    say "pipe: both ready ($RANKS ranks)"
    gpu_memory "idle, after warm-up"
    python3 benchmarks/pipeline_identity.py http://127.0.0.1:8100 http://127.0.0.1:8101 --out $O/identity.json \
      "${spec_case[@]}" > $O/identity.txt 2>&1; say "identity (rc $?): $(tr '\n' ' ' < $O/identity.txt | cut -c1-400)"
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
  devices=$(seq -s, 0 $(( RANKS - 1 )))
  # info: each replica's request lines (named replica-N, with the harness's request ids) for session_affinity.py
  python3 -m mlx_relay.cli cluster "$MODEL" --replicas "$RANKS" --replica-devices "$devices" --port 8200 \
    ${FLAGS/--log-level warning/--log-level info} > $O/cluster.log 2>&1 &
  for _ in $(seq 1 1800); do grep -q "cluster ready" $O/cluster.log && break; sleep 0.5; done
  if grep -q "cluster ready" $O/cluster.log; then
    say "cluster ready: $(grep -h 'ready on GPU' $O/cluster.log | tr '\n' ' ')"
    gpu_memory "cluster idle"
    for c in ${FLEET_LEVELS:-32}; do
      python3 -m mlx_relay.cli bench --target one=http://127.0.0.1:8201 --scenario "${FLEET_SCENARIO:-agent_fleet}" --seed 1 \
        --concurrency "$c" --requests "${FLEET_REQUESTS:-128}" --warmup 2 --out $O/fleet_one_c$c > $O/fleet_one_c$c.txt 2>&1
      say "fleet c=$c one replica (rc $?)"
      for u in $(seq 8201 $(( 8200 + RANKS ))); do get http://127.0.0.1:$u/metrics | grep -E "^mlx_relay:(request_success_total|prompt_tokens_total)" \
        | sed "s/^/$u c=$c /" >> $O/fleet_replicas.txt; done
      python3 -m mlx_relay.cli bench --target all=http://127.0.0.1:8200 --scenario "${FLEET_SCENARIO:-agent_fleet}" --seed 2 \
        --concurrency "$c" --requests "${FLEET_REQUESTS:-128}" --warmup 2 --out $O/fleet_all_c$c > $O/fleet_all_c$c.txt 2>&1
      say "fleet c=$c $RANKS replicas (rc $?)"
      for u in $(seq 8201 $(( 8200 + RANKS ))); do get http://127.0.0.1:$u/metrics | grep -E "^mlx_relay:(request_success_total|prompt_tokens_total)" \
        | sed "s/^/$u c=$c after /" >> $O/fleet_replicas.txt; done
      python3 benchmarks/session_affinity.py $O/fleet_all_c$c/bench.json --log $O/cluster.log >> $O/fleet_affinity.txt 2>&1
      python3 benchmarks/session_affinity.py $O/fleet_one_c$c/bench.json >> $O/fleet_affinity.txt 2>&1
      say "affinity c=$c: $(grep -v '^  missed' $O/fleet_affinity.txt | tail -n 2 | tr '\n' ' ')"
    done
    gpu_memory "cluster after fleet"
  else
    say "cluster not ready: $(tail -n 5 $O/cluster.log | tr '\n' ' ' | cut -c1-600)"
  fi ;;
failover)
  if grep -q "cluster ready" $O/cluster.log 2>/dev/null; then
    victim=$(grep -h "replica $RANKS pid=" $O/cluster.log | head -1 | sed 's/.*pid=\([0-9]*\).*/\1/')
    replicas=(); for u in $(seq 8201 $(( 8200 + RANKS ))); do replicas+=(--replica http://127.0.0.1:$u); done
    python3 benchmarks/cluster_failover.py http://127.0.0.1:8200 "${replicas[@]}" --victim-pid "$victim" \
      --sessions "${FAILOVER_SESSIONS:-12}" \
      --out $O/failover.json > $O/failover.txt 2>&1
    say "failover (rc $?): $(grep -E '"ok"|victim_|survivor_|hung' $O/failover.txt | tr -s ' \n' ' ')"
    grep -E "exited|stream" $O/cluster.log | tail -n 5 >> $O/failover.txt
  else
    say "failover: no cluster"
  fi
  stop_all ;;
rankkill)
  cmd=(--backend "$BACKEND" --python python3 -- -m mlx_relay.cli serve "$MODEL" --pipeline --port 8101 $FLAGS)
  launch -n "$RANKS" "${cmd[@]}" > $O/rankkill.log 2>&1 &
  launcher=$!
  if ready http://127.0.0.1:8101; then
    victim=$(rank_pid 1)
    say "rankkill: ready, rank 1 pid $victim"
    python3 benchmarks/pipeline_rank_kill.py http://127.0.0.1:8101 --victim-pid "$victim" --launcher-pid "$launcher" \
      --streams "${KILL_STREAMS:-8}" --out $O/rank_kill.json > $O/rank_kill.txt 2>&1
    say "rank kill (rc $?): $(tail -n 1 $O/rank_kill.txt | cut -c1-400)"
    wait "$launcher"; echo "launcher exit status $?" >> $O/rank_kill.txt
    stop_all
    t=$(date +%s)
    launch -n "$RANKS" "${cmd[@]}" > $O/rankkill_restart.log 2>&1 &
    if ready http://127.0.0.1:8101; then
      code=$(python3 -c "import httpx; print(httpx.post('http://127.0.0.1:8101/v1/chat/completions', timeout=300, json={'model': 'm', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 8}).status_code)")
      say "rankkill: restarted, ready after $(( $(date +%s) - t ))s, a request answered $code"
      echo "restart ready after $(( $(date +%s) - t ))s, request status $code" >> $O/rank_kill.txt
    else
      say "rankkill: the restart did not get ready: $(tail -n 3 $O/rankkill_restart.log | tr '\n' ' ' | cut -c1-400)"
    fi
  else
    say "rankkill: the pipeline did not get ready: $(tail -n 3 $O/rankkill.log | tr '\n' ' ' | cut -c1-400)"
  fi
  stop_all ;;
big)
  shape=${BIG_SHAPE:-122b-a10b}; bits=${BIG_BITS:-8}
  need=$(python3 -c "print({'122b-a10b': 135, '397b-a17b': 430, '35b-a3b': 40}['$shape'] * $bits // 8)")  # GB
  [ "$LOCAL" = 1 ] || rm -rf "$MODEL" "$RUN/draft"  # the 35B model (38.6 GB): the disk holds one
  spill=()
  if [ -z "${BIG_DIR:-}" ]; then
    # a tmpfs of BIG_TMPFS_GB (the VM's memory grows as it is filled), the layers past it spilled to the disk
    mkdir -p /big && { mountpoint -q /big || mount -t tmpfs -o size=${BIG_TMPFS_GB:-150}G tmpfs /big; } 2>> $O/big_disk.txt
    if mountpoint -q /big; then BIG_DIR=/big/m; spill=(--spill-dir /root/big-spill); else BIG_DIR=/root/big; fi
  fi
  { df -h /big /dev/shm /root 2>/dev/null; free -g 2>/dev/null; } >> $O/big_disk.txt
  avail() { df -BG --output=avail "$1" 2>/dev/null | tail -n 1 | tr -dc 0-9; }
  mkdir -p "$BIG_DIR"; room=$(avail "$BIG_DIR")
  [ ${#spill[@]} -gt 0 ] && room=$(( room + $(avail /root) - 8 ))
  if [ ! -f "$BIG_DIR/config.json" ] && [ "$LOCAL" != 1 ] && [ -n "$room" ] && [ "$room" -le "$need" ]; then
    say "big: $shape at $bits bits needs ~${need} GB, $BIG_DIR (and the disk) have ${room} GB: not built"
  elif [ ! -f "$BIG_DIR/config.json" ]; then
    t=$(date +%s)
    python3 benchmarks/gpu/build_random_model.py "$BIG_DIR" --tokenizer "$TOK" --shape "$shape" --bits "$bits" ${BIG_LAYERS:+--layers $BIG_LAYERS} \
      "${spill[@]}" $BUILD_FLAGS > $O/big_build.txt 2>&1
    rc=$?; say "big: built $shape $bits-bit into $BIG_DIR in $(( $(date +%s) - t ))s (rc $rc, $(find "$BIG_DIR" -type l | wc -l) shards spilled): $(tail -n 1 $O/big_build.txt)"
    { df -h "$BIG_DIR" /root; free -g; } >> $O/big_disk.txt 2>&1
  fi
  if [ -f "$BIG_DIR/config.json" ]; then
    python3 - "$BIG_DIR" > $O/big_fit.txt 2>&1 <<'PY'
import json, subprocess, sys
from pathlib import Path
from mlx_relay.engine.models.footprint import weights_bytes
d = Path(sys.argv[1])
w = weights_bytes(d)
try:
    cards = [int(x) * 2**20 for x in subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                                     capture_output=True, text=True, check=True).stdout.split()]
except (OSError, subprocess.CalledProcessError):
    cards = []
print(json.dumps({"weights_gib": round(w / 2**30, 2), "cards_gib": [round(c / 2**30, 2) for c in cards],
                  "one_card_left_gib": round((cards[0] - w) / 2**30, 2) if cards else None}))
PY
    say "big: $(cat $O/big_fit.txt)"
    t=$(date +%s)
    # BIG_FLAGS: the big pipeline's own serve flags (e.g. --no-warmup: its shapes are in no carried kernel cache,
    # and the warm-up compiles every batch size's; the first requests then compile theirs)
    launch -n "$RANKS" --backend "$BACKEND" --python python3 -- -m mlx_relay.cli serve "$BIG_DIR" --pipeline --port 8301 \
      ${FLAGS/--log-level warning/--log-level info} ${BIG_FLAGS:-} > $O/big_pipe.log 2>&1 &
    if ready http://127.0.0.1:8301; then
      say "big: the pipeline over $RANKS ready after $(( $(date +%s) - t ))s"
      gpu_memory "big pipeline idle"
      python3 benchmarks/pipeline_identity.py http://127.0.0.1:8301 http://127.0.0.1:8301 --out $O/big_identity.json \
        > $O/big_identity.txt 2>&1; say "big identity, two passes (rc $?): $(tr '\n' ' ' < $O/big_identity.txt | cut -c1-300)"
      for lv in "short_chat 1 ${C1_REQUESTS:-16}" "short_chat 16 ${C16_REQUESTS:-64}" "agent_sessions 8 ${AGENT_REQUESTS:-16}"; do
        set -- $lv
        python3 -m mlx_relay.cli bench --target big=http://127.0.0.1:8301 --scenario "$1" --concurrency "$2" --requests "$3" \
          --warmup 2 --no-plots --out $O/big_$1_c$2 > $O/big_$1_c$2.txt 2>&1
        say "big $1 c=$2 (rc $?): $(grep -h '^| big' $O/big_$1_c$2.txt | head -n 1 | cut -c1-200)"
      done
      gpu_memory "big pipeline after"
    else
      say "big: the pipeline did not get ready: $(tail -n 3 $O/big_pipe.log | tr '\n' ' ' | cut -c1-400)"
    fi
    stop_all
    if [ "${BIG_ONE:-0}" = 1 ]; then  # what one card does with it
      t=$(date +%s)
      CUDA_VISIBLE_DEVICES=0 python3 -m mlx_relay.cli serve "$BIG_DIR" --port 8300 $FLAGS > $O/big_one.log 2>&1 &
      one=$!
      for _ in $(seq 1 ${BIG_ONE_WAIT:-300}); do get http://127.0.0.1:8300/health > /dev/null && break; kill -0 $one 2>/dev/null || break; sleep 1; done
      if get http://127.0.0.1:8300/health > /dev/null; then
        say "big: one GPU ready after $(( $(date +%s) - t ))s"; gpu_memory "big on one GPU"
      else
        say "big: one GPU did not serve: $(tail -n 3 $O/big_one.log | tr '\n' ' ' | cut -c1-400)"
      fi
      stop_all
    fi
  fi
  stop_all
  # the model's memory back for the jobs after (a tmpfs holds it in RAM); BIG_KEEP=1 keeps it
  [ "$LOCAL" = 1 ] || [ "${BIG_KEEP:-0}" = 1 ] || rm -rf "$BIG_DIR" /root/big-spill ;;
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
  FAILOVER_SESSIONS="${FAILOVER_SESSIONS:-}" TRANSFER_ITERS="${TRANSFER_ITERS:-}" RANKS="${RANKS:-}" TOK="${TOK:-/root/tok}" \
  BUILD_FLAGS="${BUILD_FLAGS:-}" SPECPREFILL="${SPECPREFILL:-0}" BIG_LAYERS="${BIG_LAYERS:-}" BIG_KEEP="${BIG_KEEP:-0}" FLEET_LEVELS="${FLEET_LEVELS:-}" \
  bash $RUN/run.sh > $RUN/run.log 2>&1 &
echo "two started (pid $!)"
