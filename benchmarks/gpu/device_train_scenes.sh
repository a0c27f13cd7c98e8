#!/usr/bin/env bash
# Issue 30.1: fine-tune relay-tiny-agent on the agents' own requests (tools/train_agent_scenes.py)
# on the lent GPU in the background; bring back the checkpoint and the log.
#   bash benchmarks/gpu/device_train_scenes.sh start    # after the set-up calls; INIT: the checkpoint to start from
#   bash benchmarks/gpu/device_train_scenes.sh wait 560 # back to back until it prints "scenes done"
# Knobs: STEPS (800 scene steps), LR (5e-4), SECONDS_ (420: training stops and saves), EVAL (6
# examples a scene, greedy, full-length prompts), EVERY (2: a curriculum step per N scene steps),
# ROWS (8) x LENGTH (4096) curriculum rows, WORKERS (6), REFRESH (25).
# `wait` brings back $OUT/scenes.tar.xz.NN (15 MB parts: cat them | tar xJf -) once done.
RUN=${RUN:-/root/scenes}
if [ "${1:-start}" = wait ]; then
  for _ in $(seq 1 "${2:-560}"); do [ -f $RUN/done ] && break; sleep 1; done
  tail -n 25 $RUN/train.log 2>/dev/null
  if [ -f $RUN/done ]; then
    tar cJf - -C $RUN out train.log | split -b 15m -d - "$OUT/scenes.tar.xz."
    echo "scenes done"
  fi
  exit 0
fi
[ "${LOCAL:-0}" = 1 ] || source benchmarks/gpu/device_env.sh
mkdir -p $RUN/src && rm -f $RUN/done
# the call's working tree is replaced by the next call's: run from a copy; setsid: the device kills
# what is left of a call's session when the call ends
cp -r mlx_relay tools tests benchmarks $RUN/src/
cd $RUN/src && export PYTHONPATH="$RUN/src:/tmp/site"
setsid nohup bash -c "python3 tools/train_agent_scenes.py --init ${INIT:-mlx_relay/models/relay-tiny-agent} \
  --out $RUN/out --seed ${SEED:-0} --steps ${STEPS:-800} --lr ${LR:-5e-4} --max-seconds ${SECONDS_:-420} --eval ${EVAL:-6} \
  --curriculum-every ${EVERY:-2} --curriculum-rows ${ROWS:-8} --curriculum-length ${LENGTH:-4096} \
  --workers ${WORKERS:-6} --refresh ${REFRESH:-25} --log-every 10 --metrics $RUN/out/metrics.json \
  > $RUN/train.log 2>&1; echo train rc \$? >> $RUN/train.log; touch $RUN/done" > /dev/null 2>&1 &
echo started
