#!/usr/bin/env bash
# GPU call: SpecPrefill's TTFT (benchmarks/bench_specprefill.py) on the random-weight
# Qwen3.5-35B-A3B-shape target (8-bit, $MODEL, 262,144-token context) with a random bf16
# Qwen3.5-0.8B-shape draft of the same vocabulary ($DRAFT), both built here if missing.
# Same carry as device_build_and_raw.sh (README.md, lease step 2), after step 1 stashed the wheels.
#   bash benchmarks/gpu/device_specprefill.sh            # 8K/16K/32K, keep 0.3 and 0.2, 2 repeats
#   LENGTHS=8192 REPEATS=1 bash benchmarks/gpu/device_specprefill.sh
# Budget (one call, under 10 minutes on an H100): kit ~0.5 min, target build ~0.7 min, draft
# ~0.2 min, load + warm-up ~1 min, then per length one unmeasured pass of every mode and
# REPEATS measured ones, each pass about 1.5 full prefills of that length (the 8K full prefill
# took 4.6 s on an H200): ~4 minutes. Measured on an H200 (DRAFT_KIND=dense, both models built
# in the call): models 64 s, server ready 162 s later (load + warm-up), 425 s in all; an H100
# has slower memory, so there keep an eye on the margin (REPEATS=1 or LENGTHS split over calls).
# Results are rewritten after every length, so a call cut short still brings back the lengths it
# finished.
source benchmarks/gpu/device_env.sh
DRAFT=${DRAFT:-/root/qwen35-draft-random}
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
[ -f "$MODEL/config.json" ] || python3 benchmarks/gpu/build_random_model.py "$MODEL" --tokenizer /root/tok \
  2>&1 | tail -1 | tee -a "$OUT/device.txt"
# DRAFT_KIND=dense: Qwen3-0.6B's plain-attention shape instead (benchmarks/gpu/build_dense_draft.py says why)
if [ "${DRAFT_KIND:-hybrid}" = dense ]; then
  DRAFT=${DRAFT_DENSE:-/root/qwen3-dense-draft-random}
  [ -f "$DRAFT/config.json" ] || python3 benchmarks/gpu/build_dense_draft.py "$DRAFT" --tokenizer /root/tok \
    2>&1 | tail -1 | tee -a "$OUT/device.txt"
fi
[ -f "$DRAFT/config.json" ] || python3 benchmarks/gpu/build_random_model.py "$DRAFT" --tokenizer /root/tok \
  --shape draft 2>&1 | tail -1 | tee -a "$OUT/device.txt"
du -sh "$MODEL" "$DRAFT" | tee -a "$OUT/device.txt"
echo "models ready after $(( $(date +%s) - t0 ))s" | tee -a "$OUT/device.txt"
python3 benchmarks/bench_specprefill.py --target "$MODEL" --draft "$DRAFT" \
  --lengths "${LENGTHS:-8192,16384,32768}" --keeps "${KEEPS:-0.3,0.2}" --repeats "${REPEATS:-2}" \
  --warmup "${WARMUP:-1}" --chunk-size "${CHUNK:-64}" ${EXTRA:-} --out "$OUT" 2>&1 \
  | grep -v "^\[transformers\]" | tee "$OUT/log.txt"
echo "done after $(( $(date +%s) - t0 ))s" | tee -a "$OUT/device.txt"
nvidia-smi --query-gpu=memory.used --format=csv,noheader | tee -a "$OUT/device.txt"
