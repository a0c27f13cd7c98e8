#!/usr/bin/env bash
# Where the device memory goes after a burst (issue 17.1: after short_chat c=64 the device reports
# ~139 GB used by ours while MLX's allocator accounts for ~38 GB): per variant of MLX's CUDA settings,
# start ours (default flags but --no-mtp), read the device (total and per process: the server and its
# engine process) and our /metrics (MLX's active and cached bytes) when ready, after a warm pass
# (short_chat 16 streams), after short_chat c=64 and after 5 s idle.
#   VARIANTS="default graphs0 cudnn0" bash benchmarks/gpu/memory_after_burst.sh start
#   bash benchmarks/gpu/memory_after_burst.sh wait 560     # $OUT/memory.tgz
# Variants: default; graphs0 (MLX_USE_CUDA_GRAPHS=0); cudnn0 (MLX_CUDA_USE_CUDNN_SDPA=0); sdpa16
# (MLX_CUDA_SDPA_CACHE_SIZE=16: cuDNN attention plans kept); conv16 (MLX_CUDA_CONV_CACHE_SIZE=16);
# thread (--engine-process off); cache8 (--cache-limit-gb 8: MLX keeps at most 8 GB of freed buffers).
# Since 88f0c55 /metrics also reads the CUDA driver's pool under MLX (cuda_pool_reserved/used, its
# high-water mark, the device's memory in use) and the engine's log says what the idle release trims. (The knobs are those libmlx.so 0.32.4 reads: `strings libmlx.so | grep MLX_`.) LOCAL=1 MODEL=DIR RUN=DIR OUT=DIR: a dry run off the device.
RUN=${RUN:-/root/membench}
if [ "${1:-start}" = wait ]; then
  for _ in $(seq 1 "${2:-560}"); do [ -f $RUN/done ] && break; sleep 1; done
  tar czf "$OUT/memory.tgz" -C $RUN/out . 2>/dev/null || true
  tail -n 6 $RUN/progress.txt 2>/dev/null; [ -f $RUN/done ] && echo "memory done"
  exit 0
fi
if [ "${LOCAL:-0}" = 1 ]; then set -euo pipefail; else source benchmarks/gpu/device_env.sh; fi
mkdir -p $RUN/out $RUN/src && cp -r mlx_relay benchmarks $RUN/src/
[ -f "$MODEL/config.json" ] || python3 benchmarks/gpu/build_random_model.py "$MODEL" --tokenizer /root/tok 2>&1 | tail -2
cat > $RUN/run.sh <<'EOS'
set -uo pipefail
O=$RUN/out; t0=$(date +%s)
say() { echo "$(( $(date +%s) - t0 ))s $*" | tee -a $RUN/progress.txt; }
snap() {  # label
  { echo "== $1"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null
    python3 -c "import httpx; print(''.join(l + chr(10) for l in httpx.get('http://127.0.0.1:8000/metrics').text.splitlines() if ('memory' in l or 'snapshot_bytes' in l or 'cuda_pool' in l) and not l.startswith('#')))"
  } >> $O/memory.txt 2>&1
}
for v in $VARIANTS; do
  envs=() flags=()
  case $v in
    graphs0) envs=(MLX_USE_CUDA_GRAPHS=0) ;;
    cudnn0) envs=(MLX_CUDA_USE_CUDNN_SDPA=0) ;;
    sdpa16) envs=(MLX_CUDA_SDPA_CACHE_SIZE=16) ;;
    conv16) envs=(MLX_CUDA_CONV_CACHE_SIZE=16) ;;
    thread) flags=(--engine-process off) ;;
    cache8) flags=(--cache-limit-gb 8) ;;
  esac
  env "${envs[@]}" python3 -m mlx_relay.cli serve "$MODEL" --port 8000 --served-model-name qwen35-moe \
    --max-num-seqs 64 --max-queue 512 --no-mtp "${flags[@]}" > $O/$v.log 2>&1 &
  pid=$!
  for _ in $(seq 1 900); do
    kill -0 $pid 2>/dev/null || break
    python3 -c "import sys,httpx; sys.exit(httpx.get('http://127.0.0.1:8000/health', timeout=2).status_code != 200)" 2>/dev/null && break
    sleep 1
  done
  say "$v ready (server pid $pid)"; snap "$v ready (server pid $pid)"
  python3 -m mlx_relay.cli bench --target ours=http://127.0.0.1:8000 --scenario short_chat --concurrency 16 \
    --requests 16 --no-plots --out /tmp/mb-warm-$v > /dev/null 2>&1
  snap "$v after the warm pass"
  python3 -m mlx_relay.cli bench --target ours=http://127.0.0.1:8000 --scenario short_chat --concurrency 64 \
    --requests 64 --no-plots --out /tmp/mb-$v > /dev/null 2>&1
  cp /tmp/mb-$v/bench.json $O/short_chat-$v-c64.json 2>/dev/null
  snap "$v after short_chat c=64"; sleep 5; snap "$v after 5 s idle"
  grep -h "idle:" $O/$v.log | tail -n 3 >> $O/memory.txt
  say "$v done"
  kill $pid; wait $pid 2>/dev/null
done
touch $RUN/done
EOS
rm -f $RUN/done $RUN/progress.txt
cd $RUN/src
setsid nohup env RUN="$RUN" MODEL="$MODEL" VARIANTS="${VARIANTS:-default graphs0}" PYTHONPATH="$RUN/src:${PYTHONPATH:-}" \
  bash $RUN/run.sh > $RUN/run.log 2>&1 &
echo "memory run started (pid $!)"
