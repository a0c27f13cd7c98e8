#!/usr/bin/env bash
# Issue 30.6's GPU probe: on the 35B-A3B shape, a 30K-token prompt prefilling beside c=8
# short_chat-like streams (benchmarks/probe_long_beside_streams.py), once per step budget: our
# server restarted with each `--max-num-batched-tokens` of BUDGETS ("default" leaves the flag out).
# Targets: the streams' ITL p90 within 2x of without the long prompt, the long prompt's TTFT
# within 1.3x of it alone (issue 43.3).
#
# A run outlasts one device call (each server start is ~55 s with the kernel cache, ~400 s
# without), so it runs in the background and is collected (as device_matrix.sh):
#   bash benchmarks/gpu/device_short_behind_long.sh start     # builds the model if needed, starts
#   bash benchmarks/gpu/device_short_behind_long.sh wait 560  # repeat until it prints "probe done"
# Results: $OUT/short_behind_long.tgz (one probe JSON per budget, the servers' logs, progress.txt).
# Knobs: BUDGETS (default "default 256 512 1024 2048"), FACTORS (each budget once per
# `--decode-stall-factor` value: default "default", off on a GPU; e.g. "default 2 3"; files are
# named budget-factor when FACTORS is given), STREAMS (8), LONG_TOKENS (30000),
# WINDOW (seconds of streams measured alone, 30), OURS_FLAGS (e.g. --no-mtp).
# LOCAL=1 MODEL=DIR RUN=DIR OUT=DIR VOCAB=1026: a dry run off the device, e.g. on the embedded
# model: LOCAL=1 MODEL=mlx_relay/models/relay-tiny-agent RUN=/tmp/sbl OUT=/tmp/sbl-out VOCAB=1000
# LONG_TOKENS=2000 STREAMS=2 WINDOW=5 BUDGETS="default" PATH=$PWD/.venv/bin:$PATH bash $0 start
RUN=${RUN:-/root/short-behind-long}
mode=${1:-start}

if [ "$mode" = wait ]; then
  limit=${2:-560}
  for _ in $(seq 1 "$limit"); do
    [ -f $RUN/done ] && break
    sleep 1
  done
  tar czf "$OUT/short_behind_long.tgz" -C $RUN/out . 2>/dev/null || true
  tail -n 8 $RUN/progress.txt 2>/dev/null
  [ -f $RUN/done ] && echo "probe done"
  exit 0
fi
if [ "${LOCAL:-0}" = 1 ]; then set -euo pipefail; else source benchmarks/gpu/device_env.sh; fi

mkdir -p $RUN/out $RUN/src
cp -r mlx_relay benchmarks $RUN/src/
[ -f "$MODEL/config.json" ] || python3 benchmarks/gpu/build_random_model.py "$MODEL" --tokenizer /root/tok 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $RUN/out/device.txt 2>/dev/null || true
cat > $RUN/run.sh <<'INNER'
set -uo pipefail
O=$RUN/out; t0=$(date +%s)
say() { echo "$(( $(date +%s) - t0 ))s $*" | tee -a $RUN/progress.txt; }
for run in $(for b in $BUDGETS; do for f in ${FACTORS:-default}; do echo "$b/$f"; done; done); do
  budget=${run%/*}; factor=${run#*/}
  flags=""; [ "$budget" != default ] && flags="--max-num-batched-tokens $budget"
  [ "$factor" != default ] && flags="$flags --decode-stall-factor $factor"
  [ -n "${FACTORS:-}" ] && budget="$budget-$factor"
  python3 -m mlx_relay.cli serve "$MODEL" --port 8000 --served-model-name qwen35-moe --max-num-seqs 16 \
    $flags ${OURS_FLAGS:-} > $O/ours-$budget.log 2>&1 &
  pid=$!
  ok=1
  for _ in $(seq 1 900); do
    kill -0 $pid 2>/dev/null || { ok=0; break; }
    python3 -c "import sys,httpx; sys.exit(httpx.get('http://127.0.0.1:8000/health', timeout=2).status_code != 200)" \
      2>/dev/null && break
    sleep 1
  done
  [ $ok = 1 ] || { say "budget $budget: server never got ready"; continue; }
  say "budget $budget: ready"
  python3 $RUN/src/benchmarks/probe_long_beside_streams.py http://127.0.0.1:8000 --streams "${STREAMS:-8}" \
    --long-tokens "${LONG_TOKENS:-30000}" --vocab "${VOCAB:-240000}" --window "${WINDOW:-30}" \
    --json $O/probe-$budget.json > $O/probe-$budget.txt 2>&1
  say "budget $budget: $(tail -1 $O/probe-$budget.txt)"
  kill $pid; wait $pid 2>/dev/null
done
touch $RUN/done
INNER
rm -f $RUN/done $RUN/progress.txt
cd $RUN/src
setsid nohup env RUN="$RUN" MODEL="$MODEL" PYTHONPATH="$RUN/src:/tmp/site" BUDGETS="${BUDGETS:-default 256 512 1024 2048}" \
  STREAMS="${STREAMS:-8}" LONG_TOKENS="${LONG_TOKENS:-30000}" VOCAB="${VOCAB:-240000}" WINDOW="${WINDOW:-30}" \
  OURS_FLAGS="${OURS_FLAGS:-}" FACTORS="${FACTORS:-}" bash $RUN/run.sh > $RUN/run.log 2>&1 &
echo "probe started (pid $!)"
