#!/usr/bin/env bash
# GPU call 1 of a lease: build the random Qwen3.5-35B-A3B-shape model, then the raw library loop.
source benchmarks/gpu/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
[ -f "$MODEL/config.json" ] || python3 benchmarks/gpu/build_random_model.py "$MODEL" --tokenizer /root/tok \
  2>&1 | tail -3 | tee -a "$OUT/device.txt"
du -sh "$MODEL" | tee -a "$OUT/device.txt"
python3 benchmarks/gpu/raw_batch_loop.py "$MODEL" --batch "${RAW_BATCH:-1,4,16,64}" --prompt-tokens 512 \
  --max-tokens 128 --out "$OUT/raw_loop.json"
