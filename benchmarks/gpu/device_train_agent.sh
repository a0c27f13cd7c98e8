#!/usr/bin/env bash
# Issue 19: train relay-tiny-agent on the lent GPU in the background, evaluate it, bring it back.
#   bash benchmarks/gpu/device_train_agent.sh start        # carry [".device-kit/part2"]; after the set-up calls
#   bash benchmarks/gpu/device_train_agent.sh wait 560     # back to back until it prints "agent done"
# The stdlib filler (PSF-2.0) travels as .device-kit/stdlib/stdlib.tar.xz, made here by
#   python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])"  # then, from that directory's parent:
#   tar cJf .device-kit/stdlib/stdlib.tar.xz --exclude='__pycache__' --exclude='site-packages' -C DIR .
# and carried in a call of its own (carry [".device-kit/stdlib"]: `mkdir -p /tmp/stdlib && tar xJf
# .device-kit/stdlib/stdlib.tar.xz -C /tmp/stdlib`), or set FILLER=synthetic.
# Training stops at TRAIN_SECONDS (default 1200: a machine is held 30 minutes at most) or at the
# schedule's end, saves the checkpoint, then runs the evaluation (EVAL_N prompts per measure). `wait`
# brings back $OUT/agent.tar.xz.NN (the checkpoint, the training log and metrics, the evaluation;
# 15 MB parts: cat them | tar xJf -) once done, and the log's tail each time.
# Knobs: SCHEDULE (1024:1500,4096:400,16384:150), TOKENS (65536 per step), HIDDEN (256),
# INTERMEDIATE (640), LAYERS (8), LR (3e-3), WARMUP (150), WORKERS (12), LENGTHS ("4096 8192 16384"),
# SHARES (0.45,0.3,0.25: each stage's share of TRAIN_SECONDS, so every stage is reached whatever the
# device's speed; the learning rate follows the time), NO_COMPILE (default 1: the eager step, 0 compiles it; a compiled
# step spent 8 minutes of NVRTC builds, 200 kernels, on an H100 before its first step), CACHE_GB (4:
# MLX's buffer cache limit in the trainer; unbounded, it held 60 of 80 GB and the run died of a
# cudaMallocAsync out-of-memory), MEM_GB (MLX's memory limit; empty: MLX's default). A step that
# fails saves the last step trained (RESUME=1 goes on from it). SCHEDULE stages may name their rows
# a step (length:steps:rows). CONTEXT_WEIGHT (0.3): the prompts' text in the loss. EVAL=0: no
# evaluation on the device (run it off the device on the checkpoint `ckpt` brings back, which holds
# the optimizer state too, for RESUME on a later machine).
# LOCAL=1 RUN=DIR OUT=DIR (and small knobs): a dry run off the device.
RUN=${RUN:-/root/agent}
if [ "${1:-start}" = ckpt ]; then  # the checkpoint and its optimizer state, once trained (the evaluation may still run)
  grep -q "train rc" $RUN/out/train.log && tar cJf - -C $RUN out/relay-tiny-agent \
    out/relay-tiny-agent.train_state.safetensors out/train.log out/train_metrics.jsonl \
    | split -b 15m -d - "$OUT/ckpt.tar.xz." && echo "checkpoint back"
  exit 0
fi
if [ "${1:-start}" = wait ]; then
  for _ in $(seq 1 "${2:-560}"); do [ -f $RUN/done ] && break; sleep 1; done
  tail -n 3 $RUN/out/train.log 2>/dev/null; tail -n 12 $RUN/out/eval.txt 2>/dev/null
  if [ -f $RUN/done ]; then
    tar cJf - -C $RUN out | split -b 15m -d - "$OUT/agent.tar.xz."
    echo "agent done"
  fi
  exit 0
fi
if [ "${LOCAL:-0}" = 1 ]; then set -euo pipefail; else source benchmarks/gpu/device_env.sh; fi
mkdir -p $RUN/out $RUN/src && cp -r mlx_relay tools $RUN/src/
cat > $RUN/run.sh <<'EOS'
set -uo pipefail
O=$RUN/out
filler=(--filler "${FILLER:-stdlib}"); [ "${FILLER:-stdlib}" = stdlib ] && filler+=(--stdlib /tmp/stdlib)
python3 tools/train_agent_model.py --out $O/relay-tiny-agent "${filler[@]}" --hidden "${HIDDEN:-256}" \
  --intermediate "${INTERMEDIATE:-640}" --layers "${LAYERS:-8}" --max-position 32768 \
  --schedule "${SCHEDULE:-1024:1500,4096:400,16384:150}" --tokens-per-step "${TOKENS:-65536}" --lr "${LR:-3e-3}" \
  --warmup "${WARMUP:-150}" --workers "${WORKERS:-12}" --log-every 25 --save-every 250 \
  --max-seconds "${TRAIN_SECONDS:-1200}" --stage-time-shares "${SHARES:-0.45,0.3,0.25}" \
  --context-weight "${CONTEXT_WEIGHT:-0.3}" --cache-limit-gb "${CACHE_GB:-4}" ${MEM_GB:+--memory-limit-gb "$MEM_GB"} \
  $( [ "${NO_COMPILE:-1}" = 1 ] && echo --no-compile ) ${RESUME:+--resume} --metrics $O/train_metrics.jsonl > $O/train.log 2>&1
echo "train rc $?" >> $O/train.log
[ "${EVAL:-1}" = 0 ] && { touch $RUN/done; exit 0; }
python3 tools/eval_agent_model.py --model $O/relay-tiny-agent "${filler[@]}" --n "${EVAL_N:-50}" \
  --lengths ${LENGTHS:-4096 8192 16384} --out $O/agent-eval.json > $O/eval.txt 2>&1
echo "eval rc $?" >> $O/eval.txt
touch $RUN/done
EOS
rm -f $RUN/done
cd $RUN/src
setsid nohup env RUN="$RUN" PYTHONPATH="$RUN/src:${PYTHONPATH:-}" FILLER="${FILLER:-}" HIDDEN="${HIDDEN:-}" \
  INTERMEDIATE="${INTERMEDIATE:-}" LAYERS="${LAYERS:-}" SCHEDULE="${SCHEDULE:-}" TOKENS="${TOKENS:-}" LR="${LR:-}" \
  WARMUP="${WARMUP:-}" WORKERS="${WORKERS:-}" TRAIN_SECONDS="${TRAIN_SECONDS:-}" EVAL_N="${EVAL_N:-}" \
  LENGTHS="${LENGTHS:-}" SHARES="${SHARES:-}" NO_COMPILE="${NO_COMPILE:-}" RESUME="${RESUME:-}" \
  CACHE_GB="${CACHE_GB:-}" MEM_GB="${MEM_GB:-}" EVAL="${EVAL:-}" CONTEXT_WEIGHT="${CONTEXT_WEIGHT:-}" bash $RUN/run.sh > $RUN/run.log 2>&1 &
echo "agent training started (pid $!)"
