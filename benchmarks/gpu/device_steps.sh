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
# AGREE="0.6 0.75 0.8" (issue 17.5) runs instead, per rate, one after another: build a model whose MTP
#   head agrees at that block-2 acceptance (build_random_model.py --mtp-agree, 38.6 GB) into AGREE_DIR
#   (/root/agree-model), bench_mtp.py on it at batch 1 (BLOCK 2, MTP_TOKENS 128, REPEATS 2), delete it.
#   The disk (64 GB) holds one such model: on the device the plain $MODEL is deleted first.
#   Results: steps/build_agree_RATE.txt (the build's chain check), steps/mtp_agree_RATE.{json,md,txt}.
# LOCAL=1 MODEL=DIR RUN=DIR OUT=DIR: a dry run off the device (with AGREE: TOK=tokenizer dir,
#   BUILD_FLAGS=--tiny, AGREE_DIR=DIR).
RUN=${RUN:-/root/steps}
if [ "${1:-start}" = wait ]; then
  for _ in $(seq 1 "${2:-560}"); do [ -f $RUN/done ] && break; sleep 1; done
  mkdir -p "$OUT/steps" && cp -r $RUN/out/. "$OUT/steps/" 2>/dev/null || true
  tail -n 4 $RUN/progress.txt 2>/dev/null; [ -f $RUN/done ] && echo "steps done"
  exit 0
fi
if [ "${LOCAL:-0}" = 1 ]; then set -euo pipefail; else source benchmarks/gpu/device_env.sh; fi
mkdir -p $RUN/out $RUN/src && cp -r mlx_relay benchmarks $RUN/src/
if [ -n "${AGREE:-}" ]; then
  [ "${LOCAL:-0}" = 1 ] || rm -rf "$MODEL"  # the plain model (38 GB): two do not fit on the disk
else
  [ -f "$MODEL/config.json" ] || python3 benchmarks/gpu/build_random_model.py "$MODEL" --tokenizer /root/tok 2>&1 | tail -2
fi
cat > $RUN/run.sh <<'EOS'
set -uo pipefail
O=$RUN/out; t0=$(date +%s)
say() { echo "$(( $(date +%s) - t0 ))s $*" | tee -a $RUN/progress.txt; }
if [ -n "$AGREE" ]; then
  for r in $AGREE; do
    rm -rf "$AGREE_DIR"
    if python3 benchmarks/gpu/build_random_model.py "$AGREE_DIR" --tokenizer "$TOK" --mtp-agree "$r" $BUILD_FLAGS \
        > $O/build_agree_$r.txt 2>&1; then
      say "built agree $r: $(grep -h 'mtp-agree check' $O/build_agree_$r.txt)"
      python3 benchmarks/bench_mtp.py "$AGREE_DIR" --batch 1 --block "${BLOCK:-2}" --max-tokens "${MTP_TOKENS:-128}" \
        --repeats "${REPEATS:-2}" --out $O/mtp_agree_$r.json > $O/mtp_agree_$r.txt 2>&1
      say "mtp agree $r done (rc $?): $(grep -h 'B=1' $O/mtp_agree_$r.txt)"
    else
      say "build agree $r failed: $(tail -n 1 $O/build_agree_$r.txt)"
    fi
    rm -rf "$AGREE_DIR"
  done
  touch $RUN/done
  exit 0
fi
python3 benchmarks/gpu/memory_release_probe.py --gb 40 > $O/memory_release.txt 2>&1; say "memory probe done"
python3 benchmarks/bench_decode_step.py "$MODEL" --batch "${BATCH:-1,4}" --steps "${STEPS:-32}" \
  --repeats "${REPEATS:-3}" --out $O/decode_step.json > $O/decode_step.txt 2>&1; say "decode step done"
python3 benchmarks/bench_mtp.py "$MODEL" --batch "${BATCH:-1,4}" --block "${BLOCK:-2}" --eager-mtp \
  --max-tokens "${MTP_TOKENS:-64}" --repeats 2 --out $O/mtp.json > $O/mtp.txt 2>&1; say "mtp done"
touch $RUN/done
EOS
rm -f $RUN/done $RUN/progress.txt
cd $RUN/src
setsid nohup env RUN="$RUN" MODEL="${MODEL:-}" PYTHONPATH="$RUN/src:${PYTHONPATH:-}" BATCH="${BATCH:-}" BLOCK="${BLOCK:-}" \
  MTP_TOKENS="${MTP_TOKENS:-}" STEPS="${STEPS:-}" REPEATS="${REPEATS:-}" AGREE="${AGREE:-}" \
  AGREE_DIR="${AGREE_DIR:-/root/agree-model}" TOK="${TOK:-/root/tok}" BUILD_FLAGS="${BUILD_FLAGS:-}" \
  bash $RUN/run.sh > $RUN/run.log 2>&1 &
echo "steps started (pid $!)"
