#!/usr/bin/env bash
# The in-process GPU figures of issue 17.3/17.4, one after another on one machine, no server:
#   1. memory_release_probe.py: does freed MLX memory go back to the device (CUDA backend)
#   2. bench_decode_step.py: mlx-vlm's own decode step vs ours (eager, compiled), per token
#   3. bench_mtp.py: an MTP round (compiled and eager) against a plain step; raw mlx-vlm with and
#      without its drafter
# Runs in the background (a device call lasts 10 minutes at most) and is collected:
#   bash benchmarks/gpu/device_steps.sh start    # builds the model if needed, starts the run
#   bash benchmarks/gpu/device_steps.sh wait 560 # copies what is done to $OUT/steps
# Knobs: BATCH (1,4), BLOCK (2), MTP_TOKENS (64), STEPS (32), REPEATS (3).
# LOCAL=1 MODEL=DIR RUN=DIR OUT=DIR: a dry run off the device.
RUN=${RUN:-/root/steps}
if [ "${1:-start}" = wait ]; then
  for _ in $(seq 1 "${2:-560}"); do [ -f $RUN/done ] && break; sleep 1; done
  mkdir -p "$OUT/steps" && cp -r $RUN/out/. "$OUT/steps/" 2>/dev/null || true
  tail -n 4 $RUN/progress.txt 2>/dev/null; [ -f $RUN/done ] && echo "steps done"
  exit 0
fi
if [ "${LOCAL:-0}" = 1 ]; then set -euo pipefail; else source benchmarks/gpu/device_env.sh; fi
mkdir -p $RUN/out $RUN/src && cp -r mlx_relay benchmarks $RUN/src/
[ -f "$MODEL/config.json" ] || python3 benchmarks/gpu/build_random_model.py "$MODEL" --tokenizer /root/tok 2>&1 | tail -2
cat > $RUN/run.sh <<'EOS'
set -uo pipefail
O=$RUN/out; t0=$(date +%s)
say() { echo "$(( $(date +%s) - t0 ))s $*" | tee -a $RUN/progress.txt; }
python3 benchmarks/gpu/memory_release_probe.py --gb 40 > $O/memory_release.txt 2>&1; say "memory probe done"
python3 benchmarks/bench_decode_step.py "$MODEL" --batch "${BATCH:-1,4}" --steps "${STEPS:-32}" \
  --repeats "${REPEATS:-3}" --out $O/decode_step.json > $O/decode_step.txt 2>&1; say "decode step done"
python3 benchmarks/bench_mtp.py "$MODEL" --batch "${BATCH:-1,4}" --block "${BLOCK:-2}" --eager-mtp \
  --max-tokens "${MTP_TOKENS:-64}" --repeats 2 --out $O/mtp.json > $O/mtp.txt 2>&1; say "mtp done"
touch $RUN/done
EOS
rm -f $RUN/done $RUN/progress.txt
cd $RUN/src
setsid nohup env RUN="$RUN" MODEL="$MODEL" PYTHONPATH="$RUN/src:${PYTHONPATH:-}" BATCH="${BATCH:-}" BLOCK="${BLOCK:-}" \
  MTP_TOKENS="${MTP_TOKENS:-}" STEPS="${STEPS:-}" REPEATS="${REPEATS:-}" bash $RUN/run.sh > $RUN/run.log 2>&1 &
echo "steps started (pid $!)"
