#!/usr/bin/env bash
# Issue 17.8's one command: ours, the raw mlx-vlm loop and mlx_vlm.server on one machine, one
# after another, on the same model: short_chat at c=1 and c=64 (all three) and agent_sessions at
# c=4 and c=16 (both servers, prefix caches on: ours by default, theirs with APC); for ours first
# the first-request probe (issue 17.6: 10 new prompt lengths right after "ready"). Every server
# gets the same unmeasured warm pass before it is measured. GPU memory is read after each c=64
# burst, with our prefix cache's own account of what it holds.
#
# A run outlasts one device call (10 minutes), so it runs in the background and is collected:
#   bash benchmarks/gpu/device_matrix.sh start     # builds the model if needed, starts the run
#   bash benchmarks/gpu/device_matrix.sh wait 560  # waits up to 560 s; copies what is done to $OUT
# (repeat `wait` back to back until it prints "matrix done"). Results land in $OUT/matrix/, one
# bench JSON per server, scenario and level, plus probe.json, memory.txt and the servers' logs;
# `python benchmarks/gpu/summarize.py DIR` tables them.
# Knobs: OURS_SRC (our package from `git archive`), OURS_FLAGS (e.g. --no-mtp), SERVERS
# (default "ours mlx_vlm raw"; also "oursthread": ours with the engine on a thread of the server,
# `--engine-process off`, to compare with ours' default on a GPU, the engine in a process of its own),
# SHORT="1:16 64:128", AGENT="4:24 16:48", WARM=64:64, per server SHORT_<name> / AGENT_<name>
# (e.g. SHORT_mlx_vlm="1:12" AGENT_oursthread=""), PROBE=COUNT:MIN:MAX prompt lengths (10:100:8000;
# "none" skips it), PROBE_VOCAB (token ids drawn below it).
# `wait` brings back one archive, $OUT/matrix.tgz (a call returns at most 8 files), and at the end
# the machine's MLX kernel cache (/tmp/mlx: NVRTC output) as $OUT/ptx-cache.tar.xz.NN (16 MB parts):
# put them in .device-kit/ptx/ and device_env.sh unpacks them on the next machine, whose first
# server start then skips minutes of kernel builds.
# LOCAL=1 MODEL=DIR RUN=DIR: a dry run off the device (no kit, no nvidia-smi), to check the script.
RUN=${RUN:-/root/matrix}
mode=${1:-start}

if [ "$mode" = wait ]; then
  limit=${2:-560}
  for _ in $(seq 1 "$limit"); do
    [ -f $RUN/done ] && break
    sleep 1
  done
  tar czf "$OUT/matrix.tgz" -C $RUN/out . 2>/dev/null || true
  if [ -f $RUN/done ] && [ -d /tmp/mlx ] && [ "${PTX:-1}" = 1 ]; then
    tar cJf - -C /tmp mlx | split -b 15m -d - "$OUT/ptx-cache.tar.xz."
  fi
  tail -n 5 $RUN/progress.txt 2>/dev/null; grep "warm-up" $RUN/out/ours.log 2>/dev/null | tail -n 2
  [ -f $RUN/done ] && echo "matrix done"
  exit 0
fi
if [ "${LOCAL:-0}" = 1 ]; then set -euo pipefail; else source benchmarks/gpu/device_env.sh; fi

mkdir -p $RUN/out $RUN/src
# the run reads its code from a copy: a later call may replace this working tree under it
cp -r mlx_relay benchmarks $RUN/src/
[ -f "$MODEL/config.json" ] || python3 benchmarks/gpu/build_random_model.py "$MODEL" --tokenizer /root/tok 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $RUN/out/device.txt || true
cat > $RUN/run.sh <<'EOF'
set -uo pipefail
O=$RUN/out; t0=$(date +%s)
say() { echo "$(( $(date +%s) - t0 ))s $*" | tee -a $RUN/progress.txt; }
ready() {  # url pid: 0 once the url answers 200, 1 if the process died or 900 s passed
  for _ in $(seq 1 900); do
    kill -0 "$2" 2>/dev/null || return 1
    python3 -c "import sys,httpx; sys.exit(httpx.get('$1', timeout=2).status_code != 200)" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}
bench() {  # target-args... -- scenario levels:requests name
  local args=() ; while [ "$1" != -- ]; do args+=("$1"); shift; done; shift
  local scenario=$1 spec=$2 name=$3
  python3 -m mlx_relay.cli bench "${args[@]}" --scenario "$scenario" --concurrency "${spec%%:*}" \
    --requests "${spec##*:}" --no-plots --out "/tmp/m-$name" --duration 420 > "/tmp/m-$name.txt" 2>&1
  case $name in warm-*) return ;; esac  # the warm pass is not a figure
  cp "/tmp/m-$name/bench.json" "$O/$name.json" 2>/dev/null || say "$name: no result (see /tmp/m-$name.txt)"
}
memory() {  # label [our url]: the device's account, and ours of MLX's active and cached bytes
  echo "$1: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null)" >> $O/memory.txt
  [ -n "${2:-}" ] && python3 -c "import httpx; print(''.join(l + chr(10) for l in httpx.get('$2/metrics').text.splitlines() if 'memory' in l or 'snapshot_bytes' in l))" >> $O/memory.txt 2>&1
}
[ -f $RUN/levels.sh ] && source $RUN/levels.sh
for name in ${SERVERS}; do
  if [ "$name" = raw ]; then
    target=(--raw-loop "$MODEL")
    bench "${target[@]}" -- short_chat "${WARM:-64:64}" "warm-raw"
    for spec in ${SHORT_raw-$SHORT}; do
      bench "${target[@]}" -- short_chat "$spec" "short_chat-raw-c${spec%%:*}"; say "raw short_chat ${spec%%:*} done"
      [ "${spec%%:*}" = 64 ] && memory "raw after short_chat c=64"
    done
    continue
  fi
  short_var=SHORT_$name agent_var=AGENT_$name
  shorts=${!short_var-$SHORT} agents=${!agent_var-$AGENT}
  if [ "$name" = ours ] || [ "$name" = oursthread ]; then
    extra=""; [ "$name" = oursthread ] && extra="--engine-process off"
    PYTHONPATH="${OURS_SRC:-$RUN/src}:/tmp/site" python3 -m mlx_relay.cli serve "$MODEL" --port 8000 \
      --served-model-name qwen35-moe --max-num-seqs 64 --max-queue 512 ${OURS_FLAGS:-} $extra > $O/$name.log 2>&1 &
    health=http://127.0.0.1:8000/health
  else
    APC_ENABLED=1 APC_DISK_ENABLED=0 python3 -m mlx_vlm.server --model "$MODEL" --host 127.0.0.1 --port 8000 \
      --max-num-seqs 64 > $O/mlx_vlm.log 2>&1 &
    health=http://127.0.0.1:8000/v1/models
  fi
  pid=$!
  ready $health $pid || { say "$name never got ready"; kill $pid 2>/dev/null; continue; }
  say "$name ready"
  target=(--target "$name=http://127.0.0.1:8000")
  if [ "$name" = ours ] && [ "${PROBE:-}" != none ]; then
    probe=${PROBE:-10:100:8000}; IFS=: read -r count lo hi <<< "$probe"
    python3 benchmarks/first_request_ttft.py http://127.0.0.1:8000 --count "$count" --min "$lo" --max "$hi" \
      --vocab "${PROBE_VOCAB:-240000}" --json $O/probe.json > $O/probe.txt 2>&1; say "probe: $(tail -1 $O/probe.txt)"
  fi
  bench "${target[@]}" -- short_chat "${WARM:-64:64}" "warm-$name"; say "$name warm"
  ourl=""; [ "$name" != mlx_vlm ] && ourl=http://127.0.0.1:8000
  for spec in ${shorts}; do
    bench "${target[@]}" -- short_chat "$spec" "short_chat-$name-c${spec%%:*}"; say "$name short_chat ${spec%%:*} done"
    if [ "${spec%%:*}" = 64 ]; then
      memory "$name after short_chat c=64" $ourl
      [ -n "$ourl" ] && python3 -c "import httpx; print(httpx.get('http://127.0.0.1:8000/v1/cache/stats').text)" >> $O/memory.txt
    fi
  done
  for spec in ${agents}; do
    bench "${target[@]}" -- agent_sessions "$spec" "agent_sessions-$name-c${spec%%:*}"; say "$name agent ${spec%%:*} done"
  done
  memory "$name after agent_sessions" $ourl
  kill $pid; wait $pid 2>/dev/null
  say "$name out-of-memory lines: $(grep -c 'out of memory' $O/$name.log)"
done
touch $RUN/done
EOF
rm -f $RUN/done $RUN/progress.txt
levels=$(compgen -v | grep -E '^(SHORT|AGENT)_' || true)
if [ -n "$levels" ]; then declare -p $levels > $RUN/levels.sh; else : > $RUN/levels.sh; fi
cd $RUN/src
# setsid: the device kills what is left of a call's session when the call ends
setsid nohup env RUN="$RUN" PROBE="${PROBE:-}" PROBE_VOCAB="${PROBE_VOCAB:-}" PYTHONPATH="$RUN/src:/tmp/site" SERVERS="${SERVERS-ours mlx_vlm raw}" SHORT="${SHORT-1:16 64:128}" AGENT="${AGENT-4:24 16:48}" WARM="${WARM:-}" OURS_SRC="${OURS_SRC:-}" \
  OURS_FLAGS="${OURS_FLAGS:-}" MODEL="$MODEL" bash $RUN/run.sh > $RUN/run.log 2>&1 &
echo "matrix started (pid $!)"
