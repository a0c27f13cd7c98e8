#!/usr/bin/env bash
# GPU call: SpecPrefill's TTFT (benchmarks/bench_specprefill.py) on the random-weight
# Qwen3.5-35B-A3B-shape target (8-bit, $MODEL, 262,144-token context): no SpecPrefill (`off`)
# against SpecPrefill with a draft of the same vocabulary, built here if missing, and at the end
# one table of them all (benchmarks/gpu/specprefill_compare.py; also $OUT/specprefill-compare.md).
#   DRAFT_KIND=hybrid (default): a random bf16 Qwen3.5-0.8B-shape draft ($DRAFT; 3 GatedDeltaNet : 1
#     attention). Since issue 19.5 the server loads it through mlx-vlm, whose GatedDeltaNet prefill
#     off Metal is a chunked scan (mlx_relay/engine/scoring/draft_library.py); through mlx-lm (a per-token
#     loop on CUDA) it scored 8K tokens in 10 s, slower than the target's whole prefill
#     (benchmarks/results/specprefill-gpu-h200-2026-11-21/hybrid-draft). The log's `draft:` line
#     says which library ran it.
#   DRAFT_KIND=dense: Qwen3-0.6B's plain-attention shape instead ($DRAFT_DENSE, mlx-lm;
#     benchmarks/gpu/build_dense_draft.py says why).
#   DRAFT_KIND=both: hybrid, then dense, each in a server of its own ($OUT/hybrid, $OUT/dense): two
#     loads, so keep it short (LENGTHS=8192,16384 REPEATS=1) to stay under 10 minutes.
# Same carry as device_build_and_raw.sh (README.md, lease step 2), after step 1 stashed the wheels.
#   bash benchmarks/gpu/device_specprefill.sh            # hybrid draft, 8K/16K/32K, keep 0.3 and 0.2, 2 repeats
#   LENGTHS=8192 REPEATS=1 bash benchmarks/gpu/device_specprefill.sh
#   DRAFT_KIND=both LENGTHS=8192,16384 REPEATS=1 bash benchmarks/gpu/device_specprefill.sh
# Budget (one call, under 10 minutes on an H100): kit ~0.5 min, target build ~0.7 min, draft
# ~0.2 min, load + warm-up ~1 min, then per length one unmeasured pass of every mode and
# REPEATS measured ones, each pass about 1.5 full prefills of that length (the 8K full prefill
# took 4.6 s on an H200): ~4 minutes. Measured on an H200 (DRAFT_KIND=dense, both models built
# in the call): models 64 s, server ready 162 s later (load + warm-up), 425 s in all; an H100
# has slower memory, so there keep an eye on the margin (REPEATS=1 or LENGTHS split over calls).
# Results are rewritten after every length, so a call cut short still brings back the lengths it
# finished.
# LOCAL=1 TOK=DIR RUN=DIR OUT=DIR: a dry run on a CPU (no kit, no nvidia-smi): the same steps with
# --tiny models built under $RUN from the tokenizer in TOK (a fixture's: it has Qwen3.5's special
# tokens), e.g. TOK=$(python -c 'from mlx_relay.testing.fixtures import *; print(fixture_path(FixtureSpec()))')
#   LOCAL=1 TOK=$TOK RUN=/tmp/sp OUT=/tmp/sp-out DRAFT_KIND=both LENGTHS=512 KEEPS=0.3 REPEATS=1 \
#     bash benchmarks/gpu/device_specprefill.sh
if [ "${LOCAL:-0}" = 1 ]; then
  set -euo pipefail
  RUN=${RUN:?LOCAL=1 needs RUN=DIR}; TOK=${TOK:?LOCAL=1 needs TOK=DIR}
  mkdir -p "$RUN" "$OUT"
  MODEL=${MODEL:-$RUN/target-tiny}; DRAFT=${DRAFT:-$RUN/hybrid-draft-tiny}; DRAFT_DENSE=${DRAFT_DENSE:-$RUN/dense-draft-tiny}
  TINY=--tiny
  export PYTHONPATH="$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
else
  source benchmarks/gpu/device_env.sh
  TOK=/root/tok TINY=
  DRAFT=${DRAFT:-/root/qwen35-draft-random}
  DRAFT_DENSE=${DRAFT_DENSE:-/root/qwen3-dense-draft-random}
fi
KIND=${DRAFT_KIND:-hybrid}
case "$KIND" in hybrid) kinds=(hybrid) ;; dense) kinds=(dense) ;; both) kinds=(hybrid dense) ;;
  *) echo "DRAFT_KIND must be hybrid, dense or both (got $KIND)" >&2; exit 2 ;; esac
t0=$(date +%s)
if [ "${LOCAL:-0}" = 1 ]; then echo "LOCAL dry run on $(uname -m)" | tee "$OUT/device.txt"
else nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"; fi
[ -f "$MODEL/config.json" ] || python3 benchmarks/gpu/build_random_model.py "$MODEL" --tokenizer "$TOK" $TINY \
  2>&1 | tail -1 | tee -a "$OUT/device.txt"
for kind in "${kinds[@]}"; do
  if [ "$kind" = dense ]; then
    [ -f "$DRAFT_DENSE/config.json" ] || python3 benchmarks/gpu/build_dense_draft.py "$DRAFT_DENSE" --tokenizer "$TOK" \
      $TINY 2>&1 | tail -1 | tee -a "$OUT/device.txt"
  else
    [ -f "$DRAFT/config.json" ] || python3 benchmarks/gpu/build_random_model.py "$DRAFT" --tokenizer "$TOK" \
      --shape draft $TINY 2>&1 | tail -1 | tee -a "$OUT/device.txt"
  fi
done
du -sh "$MODEL" | tee -a "$OUT/device.txt"
echo "models ready after $(( $(date +%s) - t0 ))s" | tee -a "$OUT/device.txt"
for kind in "${kinds[@]}"; do
  draft=$DRAFT; [ "$kind" = dense ] && draft=$DRAFT_DENSE
  du -sh "$draft" | tee -a "$OUT/device.txt"
  mkdir -p "$OUT/$kind"
  python3 benchmarks/bench_specprefill.py --target "$MODEL" --draft "$draft" \
    --lengths "${LENGTHS:-8192,16384,32768}" --keeps "${KEEPS:-0.3,0.2}" --repeats "${REPEATS:-2}" \
    --warmup "${WARMUP:-1}" --chunk-size "${CHUNK:-64}" ${EXTRA:-} --out "$OUT/$kind" 2>&1 \
    | grep -v "^\[transformers\]" | tee "$OUT/$kind/log.txt"
  echo "$kind done after $(( $(date +%s) - t0 ))s" | tee -a "$OUT/device.txt"
done
python3 benchmarks/gpu/specprefill_compare.py "$OUT" --out "$OUT/specprefill-compare.md"
echo "done after $(( $(date +%s) - t0 ))s" | tee -a "$OUT/device.txt"
[ "${LOCAL:-0}" = 1 ] || nvidia-smi --query-gpu=memory.used --format=csv,noheader | tee -a "$OUT/device.txt"
