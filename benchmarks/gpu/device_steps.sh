#!/usr/bin/env bash
# In-process and single-server GPU figures, one job after another on one machine, in the background
# (a device call lasts 10 minutes at most) and collected:
#   JOBS="overhead disk snapio agree" bash benchmarks/gpu/device_steps.sh start  # builds the model if needed
#   bash benchmarks/gpu/device_steps.sh wait 560   # what is done so far as $OUT/steps.tgz
#   bash benchmarks/gpu/device_steps.sh ptx        # then: MLX's kernel cache for the next machine
# Jobs (JOBS, default "probe step mtp"; results in $OUT/steps.tgz):
#   pool     (issue 34.6) bench_model_swap.py: two 35B-A3B-shape models (b: hard links to $MODEL's files)
#            under a budget that holds one (POOL_BUDGET GiB, default 60): cold and swap TTFT, load seconds,
#            a steady a/b mix against a alone (SWAPS 4, REPEATS 3, POOL_TOKENS 128, POOL_FLAGS e.g.
#            --no-warmup; CLIENTS N, CLIENT_REQUESTS 4: N clients at once, a alone then half a, half b).
#            Results: pool_swap.*
#   kernels  kernel_check.py (issue 32.1): each CUDA kernel of the model families (engine/models/*/kernels/) against its fallback
#   count    bench_decode_step.py --count-ops --by-layer (issue 32.1): launches per step and per layer part
#   probe    memory_release_probe.py: does freed MLX memory go back to the device (CUDA backend)
#   step     bench_decode_step.py: mlx-vlm's own decode step vs ours (eager, compiled), per token
#   graphs   (issues 43.3, 45) the host's cost a launch under MLX's CUDA graph settings (its public environment:
#            each of GRAPH_ENVS, ";"-separated, default "MLX_MAX_OPS_PER_BUFFER=100" (an H100's / H200's default),
#            "MLX_MAX_OPS_PER_BUFFER=1000", "MLX_USE_CUDA_GRAPHS=0"): the compiled decode step at GRAPH_BATCH (1,8) and
#            the mixed step at GRAPH_SLICES (16,64), a process per setting. Results: graphs_N.{txt,json}
#   mtp      bench_mtp.py: an MTP round (compiled and eager) against a plain step; raw mlx-vlm with and
#            without its drafter
#   overhead bench_decode.py (issue 17.2): batch-1 decode through the raw mlx-vlm loop, our in-process
#            API and our HTTP SSE server, one process, the model loaded once per path; ours without the
#            start-up warm-up (exact prefill shapes; the first, unmeasured round compiles)
#   disk     bench_prefix_cache.py --scenarios restart (issue 18.3): an 8K system prompt cold, as a
#            memory hit, and as a disk hit after a restart; ours --no-mtp, and mlx_vlm.server with APC disk
#   snapio   bench_snapshot_io.py --tokens 8192: a snapshot's copy, write, read and load
#   spec     (issue 33.5) build the --mtp-agree model (AGREE, default 0.75: a bigram-cycle target) into
#            AGREE_DIR, bench_speculation.py --scenario copy for each RATE:BATCH of COPY (default
#            "0.7:1 0:1 0.7:16"; SPEC_TOKENS 160, MAX_DRAFT 8, REPEATS 3), delete it; first the launches of
#            a plain step, an MTP round and the head-free round at widths 1 and MAX_DRAFT + 1 (spec_ops.*).
#            With DRAFT_AGREE (issue 45.1): also a dense draft of DRAFT_LAYERS (4) layers drafting the cycle's
#            next token at that rate (build_random_model.py --shape draft --agree-with), the method "draft"
#            beside SPEC_METHODS (none,mtp,context,auto); SPEC_BLOCK (2): the MTP block size (4: rounds of 2-4
#            by the measured acceptance). Results: spec_copy_*
#   prefill  (issue 43.2) bench_prefill.py: our server against the raw mlx-vlm forward (generate_step, its
#            own chunking and caches) at PREFILL_SIZES (default 2048,8192,32768,131072) uncached tokens and
#            PREFILL_CACHED (28672+4096: a 4K suffix behind a 28K cached system prompt), REPEATS (3) each;
#            PREFILL_ORDER auto (phases on an 80 GB card: our server up for all of ours, then raw alone),
#            PREFILL_FLAGS (our server's extra flags, e.g. --no-mtp). Run it alone (JOBS=prefill: its five
#            files, of the 8 a call brings back). Results: prefill.{json,md,txt}, prefill-{ours,raw}.log
#   parts    (issue 43.2) prefill_parts.py: a prefill chunk of PARTS_CHUNK (2048) tokens at each context of
#            PARTS_CONTEXT (0,28672), the library's forward beside ours with each lever off in turn, and per
#            part (GatedDeltaNet mixer, experts, attention). Results: prefill_parts.{json,txt}
#   block    (issue 43.3) prefill_block.py: chunks of BLOCK_CHUNKS (16,64,256,1024) tokens at each context of
#            PARTS_CONTEXT (0,28672) through our prefill forward, the family's block forward eager and
#            compiled, and a decode step, for scale. Results: prefill_block.{json,txt}
#   overlap  (issue 43.3) prefill_overlap.py: 8 decoding rows' steps while an OVERLAP_PROMPT (16384)-token
#            prompt prefills in chunks of each of OVERLAP_CHUNKS (4096 2048), on one stream, on two, and queued a layer at a time on the second (OVERLAP_EVERY, "1,2,4": a decode step every N layers).
#            Results: prefill_overlap_N.{json,txt}
#   mixed    (issue 43.3) mixed_step.py: MIXED_ROWS (8) decoding rows' step alone, then beside a slice of a
#            prompt MIXED_CONTEXT (16384) tokens in, for each of MIXED_SLICES (16,64,128,256,512,1024): two
#            forwards (the decode step, the chunk's) against one (the plain lane's mixed step, and the same
#            forward with no part compiled: `eager`); a lone
#            4,096-token chunk's rate for the TTFT ratio, for each of MIXED_EXPERTS (default EXPERTS, else
#            narrow, what a server on CUDA runs: the chunk's experts, each optionally :MIN_PAIRS, the pairs from
#            which they run grouped, e.g. "kernel narrow:256"; narrow only where this run's kernel check passed
#            it, else kernel). UNMERGED=1: also the mixed step over an unmerged copy of the model.
#            Results: mixed_step_EXPERTS[_MIN_PAIRS].{json,txt}
#   specops  (issue 45.3) the launches of a plain step, an MTP round and the head-free round at widths 1 and
#            MAX_DRAFT + 1 on $MODEL (as spec's first step, without building a model). spec_ops.*
#   specmiss (issue 45.2) bench_speculation.py on $MODEL (random: the head's and the context's drafts miss) at
#            batch 1, copy rate 0, SPEC_METHODS (none,context,auto,mtp), then --profile: kernels and host
#            time a token per method (gpu/step_recorder.py), then again on engines that served a pass first
#            (--served-before 1). Results: spec_miss.{json,md,txt}, spec_miss_served.{json,txt}
#   hostprof (issue 45.2) where a lone row's round spends its host time, natively: bench_speculation.py as
#            specmiss, one method of HOSTPROF_METHODS (none context) a run, under py-spy (the kit's wheel,
#            PYSPY) with native frames (MLX's C++ under each Python call), HOSTPROF_RATE samples a second (100: at
#            500 it fell 14 s behind on an H200 host). Results: hostprof_METHOD.{txt,log}
#            (collapsed stacks: `python3 benchmarks/gpu/host_split.py` splits them)
#   explicit (issue 43.3) mixed_explicit.py: MIXED_ROWS (8) rows' step beside a slice of a prompt MIXED_CONTEXT
#            (16384) tokens in, for each of EXPLICIT_SLICES (16,64,256,512): the compiled decode step alone, the
#            engine's mixed step, and the mixed step with the chunk's caches explicit too, eager and as one
#            compiled function (the next lever's ceiling). Results: mixed_explicit.{json,txt}
#   grouped  (issue 43.3) gpu/grouped_kernels_bench.py: one expert projection (up, down) at GROUPED_ROUTES pairs,
#            grouped_qmv's kernel, grouped_qmm's, dequantized + gather_mm, MLX's gather_qmm sorted and not, pair_qmv's (QMV_SHAPES: grouped_qmv split
#            other ways, e.g. "8,32,4,2 4,32,8,4"; GROUPED_DENSE "1,8": the few-row kernels as a dense projection
#            against MLX's quantized_matmul at those rows; GROUPED_HOT 0.5: each route count again with half its pairs on 16
#            experts). grouped_kernels.*
#   profile  (issue 43.3) gpu/kernel_profile.py: per kernel, the device time of the decode step (MIXED_ROWS rows, one
#            row), a chunk alone and the mixed step at PROFILE_SLICES (64,256,512), a prompt MIXED_CONTEXT in
#            (EXPERTS, MIN_ROUTES as mixed's; narrow falls back to kernel where the check did not pass it)
#            (CUPTI through the machine's torch.profiler): busy against wall, the top kernels. kernel_profile.{json,txt}
#   sbl      (issue 43.3) device_short_behind_long.sh run inside this job (its knobs: BUDGETS, FACTORS,
#            OURS_FLAGS, STREAMS, LONG_TOKENS, WINDOW), so it follows the jobs before it on the same
#            machine; SBL_NARROW=1 adds --prefill-experts narrow where this run's kernel check passed it.
#            Results: short_behind_long.tgz, sbl.txt
#   rivals   (issue 45.4) ours with no flags beside each of RIVALS ("name=flags;...", default "wide=--mtp-max-batch
#            16;none=--speculation none") in turn, both capped (MEM_GB 62), one alternating harness run a level of
#            RIVAL_LEVELS ("16:64 64:64"), short_chat; RIVAL_OURS_FLAGS: ours' own (e.g. --speculation none
#            beside "kv8=--speculation none --kv-bits 8"). Results: rivals_NAME_C.{json,txt}, the servers' logs
#   embed    (issue 47.1) a random Qwen3-Embedding-0.6B-shaped model served beside ours (--embedding-model),
#            probe_embeddings_beside_streams.py: STREAMS (8) streams' ITL alone and beside EMBED_CLIENTS (2)
#            clients of EMBED_INPUTS (32) inputs of EMBED_TOKENS (512) tokens (ids below EMBED_VOCAB, 150000;
#            a dry run's tiny tokenizer: 1000), the embeddings' rate alone and beside (WINDOW 20 s).
#            Results: embed_probe.{json,txt}, build_embed.txt, embed_ours.log
#   kvq      (issue 47.2) gpu/kv_quant_probe.py: KVQ_ROWS (1,16) rows at KVQ_CONTEXT (131072) tokens each, KV
#            unquantized / 8 / 4-bit (KVQ_BITS): the buffers' bytes, peak memory, the compiled decode step; then
#            bench_prefill.py at KVQ_PREFILL (32768) with --kv-bits KVQ_PREFILL_BITS (8; ours). kv_quant_probe.*,
#            prefill_kvBITS.*
#   vision   (issue 47.3) ours and mlx_vlm.server side by side (capped at MEM_GB), bench_vision_cache.py
#            (VISION_MEDIA both: an image, then an 8-frame MP4 where OpenCV is there to write it): a new
#            VISION_SIZE (1024) image cold, in a new conversation, then the first conversation's next turn,
#            REPEATS times alternating. Results: vision_cache.{json,txt}, the servers' logs
#   With QMM_FLAGS (e.g. "--prefill-experts kernel"): the prefill and sbl jobs add them to our server's
#   flags only if the kernels job ran first and passed our grouped 8-bit kernel (grouped_qmm and the
#   grouped experts through it); qmm.txt says which.
#   agree    (issue 17.5) per rate of AGREE (default "0.6 0.75 0.8"): build a model whose MTP head agrees
#            at that block-2 acceptance (build_random_model.py --mtp-agree, 38.6 GB) into AGREE_DIR
#            (/root/agree-model), bench_mtp.py on it at batch 1 (BLOCK 2, MTP_TOKENS 128, REPEATS 2),
#            delete it. The disk (64 GB) holds one such model: the plain $MODEL is deleted first, so
#            put agree last. Results: build_agree_RATE.txt (the build's chain check), mtp_agree_RATE.*
# DENSE ("8bit"; "8bit 16bit": step, mixed and profile run again with --dense-16bit, files tagged _d16).
# LIBRARY_EXPERTS=1: step also times the compiled step with the library's experts (kernels/pair_qmv.py's other side).
# UNMERGED=1: step also times it over a second copy of the model, projections unmerged (models/merged_projections.py).
# Knobs: BATCH (1,4), BLOCK (2), MTP_TOKENS (64), STEPS (32), REPEATS (3), ROUNDS (3, overhead),
#   DISK_REPEATS (3).
# LOCAL=1 MODEL=DIR RUN=DIR OUT=DIR: a dry run off the device (with agree: TOK=tokenizer dir,
#   BUILD_FLAGS=--tiny, AGREE_DIR=DIR).
RUN=${RUN:-/root/steps}
if [ "${1:-start}" = ptx ]; then
  # the machine's MLX kernel cache (/tmp/mlx: NVRTC output) as $OUT/ptx-cache.tar.xz.NN (15 MB parts), in
  # a call of its own (a call brings back at most 8 files): put them in .device-kit/ptx/ and
  # device_env.sh unpacks them on the next machine, whose first traces then skip minutes of builds
  [ -d /tmp/mlx ] && tar cJf - -C /tmp mlx | split -b 15m -d - "$OUT/ptx-cache.tar.xz."
  ls "$OUT"; exit 0
fi
if [ "${1:-start}" = wait ]; then
  for _ in $(seq 1 "${2:-560}"); do [ -f $RUN/done ] && break; sleep 1; done
  # one archive of everything so far (a call brings back at most 8 files): tar xzf steps.tgz
  tar czf "$OUT/steps.tgz" -C $RUN/out . 2>/dev/null || true
  cut -c1-600 $RUN/progress.txt 2>/dev/null; [ -f $RUN/done ] && echo "steps done"
  exit 0
fi
if [ "${LOCAL:-0}" = 1 ]; then set -euo pipefail; else source benchmarks/gpu/device_env.sh; fi
mkdir -p $RUN/out $RUN/src && cp -r mlx_relay benchmarks $RUN/src/
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || true)}  # the copy in $RUN/src has no .git
JOBS=${JOBS:-probe step mtp}
if [ "$JOBS" != agree ] && [ "$JOBS" != spec ] && [ ! -f "$MODEL/config.json" ]; then
  python3 benchmarks/gpu/build_random_model.py "$MODEL" --tokenizer /root/tok 2>&1 | tail -2
fi
cat > $RUN/run.sh <<'EOS'
set -uo pipefail
O=$RUN/out; t0=$(date +%s)
say() { echo "$(( $(date +%s) - t0 ))s $*" | tee -a $RUN/progress.txt; }
qmm_flags() {  # QMM_FLAGS when this run's kernel check passed our grouped 8-bit kernel, else nothing
  [ -n "${QMM_FLAGS:-}" ] && [ -f $O/kernel_check.json ] && python3 - $O/kernel_check.json <<'PY' && echo "$QMM_FLAGS"
import json, sys
c = json.load(open(sys.argv[1]))["checks"]
ok = c["grouped_qmm"] and all(x["ok"] for x in c["grouped_qmm"])
ok = ok and all(x["ok"] for x in c["grouped_experts"] if x.get("kernel"))
sys.exit(0 if ok else 1)
PY
}
alive() { for p in "$@"; do kill -0 "$p" 2>/dev/null || return 1; done; }  # every server still running
dense_flag() { [ "$1" = 16bit ] && echo --dense-16bit; true; }  # DENSE's variants: 8bit (the default), 16bit
dense_tag() { [ "$1" = 16bit ] && echo _d16; true; }
narrow_ok() {  # this run's kernel check passed narrow_qmm's tensor-core kernel
  [ -f $O/kernel_check.json ] && python3 -c "import json,sys; c=json.load(open(sys.argv[1]))['checks'].get('narrow_qmm'); sys.exit(0 if c and all(x['ok'] for x in c) else 1)" $O/kernel_check.json
}
for job in $JOBS; do case $job in
agree)
  [ "$LOCAL" = 1 ] || rm -rf "$MODEL"  # the plain model (38 GB): two do not fit on the disk
  for r in ${AGREE:-0.6 0.75 0.8}; do
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
  done ;;
spec)
  # issue 33.5: a model whose greedy continuation is a bigram cycle (the --mtp-agree build; its head
  # agrees at AGREE), prompts that copy that continuation at each rate of COPY, bench_speculation.py
  [ "$LOCAL" = 1 ] || rm -rf "$MODEL"
  rm -rf "$AGREE_DIR"
  if python3 benchmarks/gpu/build_random_model.py "$AGREE_DIR" --tokenizer "$TOK" --mtp-agree "${AGREE:-0.75}" \
      $BUILD_FLAGS > $O/build_spec.txt 2>&1; then
    say "built: $(grep -h 'mtp-agree check' $O/build_spec.txt)"
    python3 benchmarks/bench_decode_step.py "$AGREE_DIR" --batch 1 --prompt-tokens 64 --count-ops --mtp-block 2 \
      --spec-widths "1,$(( ${MAX_DRAFT:-8} + 1 ))" --out $O/spec_ops.json > $O/spec_ops.txt 2>&1
    say "spec ops (rc $?): $(grep -h 'batch 1\|round' $O/spec_ops.txt | tr '\n' ' ')"
    draft=()
    if [ -n "${DRAFT_AGREE:-}" ]; then  # issue 45.1: a small dense draft agreeing with the cycle at DRAFT_AGREE
      rm -rf "$AGREE_DIR-draft"
      python3 benchmarks/gpu/build_random_model.py "$AGREE_DIR-draft" --tokenizer "$TOK" --shape draft \
        --agree-with "$DRAFT_AGREE" --draft-layers "${DRAFT_LAYERS:-4}" $BUILD_FLAGS > $O/build_draft.txt 2>&1 \
        && draft=(--draft-model "$AGREE_DIR-draft" --methods "${SPEC_METHODS:-none,mtp,context,auto,draft}")
      say "draft: $(tail -n 2 $O/build_draft.txt | tr '\n' ' ')"
    fi
    for case in ${COPY:-0.7:1 0:1 0.7:16}; do
      r=${case%%:*}; b=${case##*:}
      python3 benchmarks/bench_speculation.py "$AGREE_DIR" --scenario copy --copy-rate "$r" --batch "$b" \
        --max-tokens "${SPEC_TOKENS:-160}" --repeats "${REPEATS:-3}" --max-draft "${MAX_DRAFT:-8}" "${draft[@]}" \
        --block "${SPEC_BLOCK:-2}" \
        --out $O/spec_copy_${r}_b$b.json > $O/spec_copy_${r}_b$b.txt 2>&1
      say "spec copy $r b$b (rc $?): $(grep -h 'B=' $O/spec_copy_${r}_b$b.txt | tail -n 5 | tr '\n' ' ')"
    done
  else
    say "build failed: $(tail -n 1 $O/build_spec.txt)"
  fi
  rm -rf "$AGREE_DIR" "$AGREE_DIR-draft" ;;
pool)
  # issue 34.6: two 35B-A3B-shape models under a budget that holds one (POOL_BUDGET GiB, default 60): model b
  # is a second directory of hard links to model a's files (the disk holds one 38.6 GB model), so every
  # load after the first reads the files from the page cache; bench_model_swap.py: cold, warm, swaps, mix
  B_DIR="$(dirname "$MODEL")/model-b"; rm -rf "$B_DIR"; cp -al "$MODEL" "$B_DIR"
  python3 benchmarks/bench_model_swap.py "$MODEL" "$B_DIR" --budget-gb "${POOL_BUDGET:-60}" \
    --requests "${REPEATS:-3}" --swaps "${SWAPS:-4}" --max-tokens "${POOL_TOKENS:-128}" $POOL_FLAGS \
    --clients "${CLIENTS:-0}" --client-requests "${CLIENT_REQUESTS:-4}" \
    --out $O/pool_swap.json > $O/pool_swap.txt 2>&1
  say "pool (rc $?): $(grep -h '^| [0-9]' $O/pool_swap.txt)"
  rm -rf "$B_DIR" ;;
kernels)
  python3 benchmarks/gpu/kernel_check.py --out $O/kernel_check.json > $O/kernel_check.txt 2>&1
  say "kernel check (rc $?): $(tail -n 1 $O/kernel_check.txt)" ;;
count)
  python3 benchmarks/bench_decode_step.py "$MODEL" --batch "${BATCH:-1,4}" --prompt-tokens 64 --count-ops --by-layer \
    --out $O/step_ops.json > $O/step_ops.txt 2>&1; say "count done (rc $?): $(grep -h '^batch' $O/step_ops.txt | head -2)" ;;
probe)
  python3 benchmarks/gpu/memory_release_probe.py --gb 40 > $O/memory_release.txt 2>&1; say "memory probe done" ;;
graphs)
  IFS=';' read -ra settings <<< "${GRAPH_ENVS:-MLX_MAX_OPS_PER_BUFFER=100;MLX_MAX_OPS_PER_BUFFER=1000;MLX_USE_CUDA_GRAPHS=0}"
  for r in 1 ${REPEATS:+$(seq 2 "$REPEATS")}; do  # the settings alternate, REPEATS waves
    for i in "${!settings[@]}"; do
      read -ra envs <<< "${settings[$i]}"
      env "${envs[@]}" python3 benchmarks/bench_decode_step.py "$MODEL" --batch "${GRAPH_BATCH:-1,8}" --steps "${STEPS:-32}" \
        --repeats 1 --out $O/graphs_${i}_step_$r.json > $O/graphs_${i}_step_$r.txt 2>&1
      env "${envs[@]}" python3 benchmarks/mixed_step.py "$MODEL" --rows 8 --context 16384 --slices "${GRAPH_SLICES:-16,64}" \
        --steps 8 --out $O/graphs_${i}_mixed_$r.json > $O/graphs_${i}_mixed_$r.txt 2>&1
      say "graphs ${settings[$i]} wave $r: $(grep -h '^batch' $O/graphs_${i}_step_$r.txt | grep -o 'compiled [0-9.]* ms' | tr '\n' ' ')| mixed $(grep -hE '^ +[0-9]+ ' $O/graphs_${i}_mixed_$r.txt | awk '{print $1": "$4" ms"}' | tr '\n' ' ')"
    done
  done ;;
step)
  for d in ${DENSE:-8bit}; do
    python3 benchmarks/bench_decode_step.py "$MODEL" --batch "${BATCH:-1,4}" --steps "${STEPS:-32}" $(dense_flag $d) \
      ${LIBRARY_EXPERTS:+--library-experts} ${UNMERGED:+--unmerged} --repeats "${REPEATS:-3}" --out $O/decode_step$(dense_tag $d).json > $O/decode_step$(dense_tag $d).txt 2>&1
    say "decode step $d (rc $?): $(grep -h '^batch' $O/decode_step$(dense_tag $d).txt | cut -c1-200 | tr '\n' ';')"
  done ;;
mtp)
  # --raw-batch-only: the random model's ids run past the tokenizer, which stream_generate's detokenizer reads
  python3 benchmarks/bench_mtp.py "$MODEL" --batch "${BATCH:-1,4}" --block "${BLOCK:-2}" --eager-mtp --raw-batch-only \
    --max-tokens "${MTP_TOKENS:-64}" --repeats 2 --out $O/mtp.json > $O/mtp.txt 2>&1; say "mtp done" ;;
overhead)
  python3 benchmarks/bench_decode.py --model "$MODEL" --rounds "${ROUNDS:-3}" --ours prefill_shapes=exact \
    --ours warmup=false --out $O/overhead > $O/overhead.txt 2>&1; say "overhead done (rc $?)" ;;
disk)
  python3 benchmarks/bench_prefix_cache.py "$MODEL" --scenarios restart --repeats "${DISK_REPEATS:-3}" \
    --warmup-repeats 1 --ours-flags "--no-mtp --prefill-shapes exact --no-warmup" \
    --out $O/prefix_disk > $O/prefix_disk.txt 2>&1; say "disk done (rc $?)" ;;
prefill)
  python3 benchmarks/bench_prefill.py "$MODEL" --sizes "${PREFILL_SIZES:-2048,8192,32768,131072}" \
    --cached "${PREFILL_CACHED:-28672+4096}" --repeats "${REPEATS:-3}" --order "${PREFILL_ORDER:-auto}" \
    --targets "${PREFILL_TARGETS:-ours,raw}" \
    --ours-flags="$PREFILL_FLAGS $(qmm_flags | tee -a $O/qmm.txt)" --out $O/prefill.json > $O/prefill.txt 2>&1
  say "prefill (rc $?): $(grep -h '^order\|^| [0-9]\|^- ' $O/prefill.txt | tr '\n' ' ')" ;;
kvq)
  # issue 47.2: the quantized KV cache's memory and decode step at long context, then a 32K prefill with it
  python3 benchmarks/gpu/kv_quant_probe.py "$MODEL" --context "${KVQ_CONTEXT:-131072}" --rows "${KVQ_ROWS:-1,16}" \
    --bits "${KVQ_BITS:-none,8,4}" --out $O/kv_quant_probe.json > $O/kv_quant_probe.txt 2>&1
  say "kvq probe (rc $?): $(tail -n 6 $O/kv_quant_probe.txt | tr '\n' ';')"
  python3 benchmarks/bench_prefill.py "$MODEL" --sizes "${KVQ_PREFILL:-32768}" --cached none --repeats "${REPEATS:-2}" \
    --targets ours --ours-flags="--kv-bits ${KVQ_PREFILL_BITS:-8} $(qmm_flags)" --out $O/prefill_kv${KVQ_PREFILL_BITS:-8}.json \
    > $O/prefill_kv${KVQ_PREFILL_BITS:-8}.txt 2>&1
  say "kvq prefill (rc $?): $(grep -h '^| [0-9]' $O/prefill_kv${KVQ_PREFILL_BITS:-8}.txt | tr '\n' ' ')" ;;
parts)
  for chunk in ${PARTS_CHUNK:-2048}; do
    python3 benchmarks/prefill_parts.py "$MODEL" --chunk "$chunk" --context "${PARTS_CONTEXT:-0,28672}" \
      --repeats "${REPEATS:-3}" --out $O/prefill_parts_$chunk.json > $O/prefill_parts_$chunk.txt 2>&1
    say "parts $chunk (rc $?): $(grep -h '^  library\|^  ours ' $O/prefill_parts_$chunk.txt | tr -s ' ' | tr '\n' ';')"
  done ;;
sbl)
  sbl_flags="${OURS_FLAGS:-} $(qmm_flags | tee -a $O/qmm.txt)"
  if [ -n "${SBL_NARROW:-}" ]; then
    if narrow_ok; then sbl_flags="$sbl_flags --prefill-experts narrow"; else say "sbl: narrow_qmm did not pass, our default experts"; fi
  fi
  LOCAL=1 RUN=/root/sbl OUT=$O OURS_FLAGS="$sbl_flags" \
    bash benchmarks/gpu/device_short_behind_long.sh start > $O/sbl.txt 2>&1
  LOCAL=1 RUN=/root/sbl OUT=$O bash benchmarks/gpu/device_short_behind_long.sh wait 3000 >> $O/sbl.txt 2>&1
  say "sbl: $(tail -n 4 $O/sbl.txt | tr '\n' ' ')" ;;
block)
  python3 benchmarks/prefill_block.py "$MODEL" --chunks "${BLOCK_CHUNKS:-16,64,256,1024}" \
    --context "${PARTS_CONTEXT:-0,28672}" --repeats "${REPEATS:-3}" --out $O/prefill_block.json > $O/prefill_block.txt 2>&1
  say "block (rc $?): $(grep -h '^context' $O/prefill_block.txt | tr '\n' ';')" ;;
overlap)
  for c in ${OVERLAP_CHUNKS:-4096 2048}; do
    python3 benchmarks/prefill_overlap.py "$MODEL" --prompt "${OVERLAP_PROMPT:-16384}" --chunk $c \
      --steps "${STEPS:-40}" --every "${OVERLAP_EVERY:-1,2,4}" --out $O/prefill_overlap_$c.json > $O/prefill_overlap_$c.txt 2>&1
    say "overlap $c (rc $?): $(grep -h -E "^(decode|shared|two|layered)" $O/prefill_overlap_$c.txt | cut -c1-300 | tr '\n' ';')"
  done ;;
grouped)
  python3 benchmarks/gpu/grouped_kernels_bench.py --routes "${GROUPED_ROUTES:-64,576,2112,4160,8256,16384}" \
    --qmv-shapes "${QMV_SHAPES:-}" ${GROUPED_DENSE:+--dense $GROUPED_DENSE} ${GROUPED_HOT:+--hot $GROUPED_HOT} --out $O/grouped_kernels.json > $O/grouped_kernels.txt 2>&1
  say "grouped (rc $?): $(tail -n 12 $O/grouped_kernels.txt | tr -s ' ' | tr '\n' ';')" ;;
profile)
  pe=${EXPERTS:-narrow}; [ "$pe" = narrow ] && ! narrow_ok && pe=kernel  # narrow: what a server on CUDA runs
  for d in ${DENSE:-8bit}; do
    t=$(dense_tag $d)
    python3 benchmarks/gpu/kernel_profile.py "$MODEL" --rows "${MIXED_ROWS:-8}" --context "${MIXED_CONTEXT:-16384}" \
      --slices "${PROFILE_SLICES:-64,256,512}" --steps "${PROFILE_STEPS:-4}" --experts "$pe" $(dense_flag $d) \
      ${MIN_ROUTES:+--min-routes $MIN_ROUTES} --out $O/kernel_profile$t.json > $O/kernel_profile$t.txt 2>&1
    say "profile $d (rc $?): $(grep -h '^== ' $O/kernel_profile$t.txt | cut -c1-160 | tr '\n' ';')"
  done ;;
explicit)
  python3 benchmarks/mixed_explicit.py "$MODEL" --rows "${MIXED_ROWS:-8}" --context "${MIXED_CONTEXT:-16384}" \
    --slices "${EXPLICIT_SLICES:-16,64,256,512}" --steps "${STEPS:-8}" --out $O/mixed_explicit.json > $O/mixed_explicit.txt 2>&1
  say "explicit (rc $?): $(tail -n 7 $O/mixed_explicit.txt | tr -s ' ' | tr '\n' ';')" ;;
mixed)
  for spec in ${MIXED_EXPERTS:-${EXPERTS:-narrow}}; do
    e=${spec%%:*}; m=${spec#"$e"}; m=${m#:}; tag=$e${m:+_$m}
    if [ "$e" = narrow ] && ! narrow_ok; then say "mixed: narrow_qmm not passed in this run's check, kernel"; e=kernel; tag=$e${m:+_$m}; fi
    for d in ${DENSE:-8bit}; do
      t=$tag$(dense_tag $d)
      python3 benchmarks/mixed_step.py "$MODEL" --rows "${MIXED_ROWS:-8}" --context "${MIXED_CONTEXT:-16384}" \
        --slices "${MIXED_SLICES:-16,64,128,256,512,1024}" --steps "${STEPS:-8}" --alone-chunk 4096 $(dense_flag $d) \
        --experts "$e" ${m:+--min-routes $m} ${UNMERGED:+--unmerged} --out $O/mixed_step_$t.json > $O/mixed_step_$t.txt 2>&1
      say "mixed $t (rc $?): $(tail -n 8 $O/mixed_step_$t.txt | tr -s ' ' | tr '\n' ';')"
    done
  done ;;
specops)
  # issue 45.3: launches of a plain step, an MTP round (block BLOCK) and the head-free round at widths 1 and
  # MAX_DRAFT + 1 on $MODEL (the counts do not depend on the weights)
  python3 benchmarks/bench_decode_step.py "$MODEL" --batch 1 --prompt-tokens 64 --count-ops --mtp-block "${BLOCK:-2}" \
    --spec-widths "1,$(( ${MAX_DRAFT:-8} + 1 ))" --out $O/spec_ops.json > $O/spec_ops.txt 2>&1
  say "spec ops (rc $?): $(grep -h 'batch 1\|round' $O/spec_ops.txt | tr '\n' ' ')" ;;
hostprof)
  for m in ${HOSTPROF_METHODS:-none context}; do
    "${PYSPY:-/tmp/site/bin/py-spy}" record --native --rate "${HOSTPROF_RATE:-100}" --format raw -o $O/hostprof_$m.txt -- \
      python3 benchmarks/bench_speculation.py "$MODEL" --scenario copy --copy-rate 0 --batch 1 --methods "$m" --no-raw \
      --max-tokens "${SPEC_TOKENS:-400}" --repeats 1 > $O/hostprof_$m.log 2>&1
    say "hostprof $m (rc $?): $(grep -h '^B=1' $O/hostprof_$m.log | tail -n 1)"
  done
  python3 benchmarks/gpu/host_split.py $O/hostprof_*.txt > $O/host_split.txt 2>&1
  say "host split: $(head -c 600 $O/host_split.txt | tr '\n' ';')" ;;
specmiss)
  # issue 45.2 on the plain random model (its head's drafts and the context's miss): speculation by source
  # at batch 1 on a prompt no copy helps, then one pass a method with its kernels and host time recorded
  python3 benchmarks/bench_speculation.py "$MODEL" --scenario copy --copy-rate 0 --batch 1 \
    --methods "${SPEC_METHODS:-none,context,auto,mtp}" --no-raw --max-tokens "${SPEC_TOKENS:-160}" \
    --repeats "${REPEATS:-3}" --profile --out $O/spec_miss.json > $O/spec_miss.txt 2>&1
  say "specmiss (rc $?): $(grep -h '^== ' $O/spec_miss.txt | cut -c1-150 | tr '\n' ';')"
  # the same on engines that served a pass first (what a running server decodes; a fresh one pays the
  # lane's learning: benchmarks/results/speculation-miss-cpu-2026-11-29/)
  python3 benchmarks/bench_speculation.py "$MODEL" --scenario copy --copy-rate 0 --batch 1 \
    --methods "${SPEC_METHODS:-none,context,auto,mtp}" --no-raw --max-tokens "${SPEC_TOKENS:-160}" \
    --repeats "${REPEATS:-3}" --served-before 1 --out $O/spec_miss_served.json > $O/spec_miss_served.txt 2>&1
  say "specmiss served (rc $?): $(grep -h '^| 1' $O/spec_miss_served.txt | cut -c1-200)" ;;
rivals)
  # issue 45.4: our server with no flags stays up while each rival of RIVALS ("name=flags;name=flags", default
  # "wide=--mtp-max-batch 16;none=--speculation none") starts beside it (both capped at MEM_GB), is warmed
  # (WARM C:N), and ONE harness run alternates between the two for each RIVAL_LEVELS "C:N" (default
  # "16:64 64:64"), on short_chat; the rival is stopped before the next starts. Results: rivals_NAME_C.json
  caps=(--served-model-name qwen35-moe --max-num-seqs 64 --max-queue 512 --memory-limit-gb "${MEM_GB:-62}"
        --cache-limit-gb 4 --prefix-cache-gb 6)
  up() { python3 -c "import sys,httpx; sys.exit(httpx.get(sys.argv[1],timeout=2).status_code!=200)" "$1" 2>/dev/null; }
  read -ra oflags <<< "${RIVAL_OURS_FLAGS:-}"
  setsid nohup python3 -m mlx_relay.cli serve "$MODEL" --port 8100 "${caps[@]}" "${oflags[@]}" \
    > $O/rivals_ours.log 2>&1 < /dev/null &
  ours_pid=$!
  IFS=';' read -ra rivals <<< "${RIVALS:-wide=--mtp-max-batch 16;none=--speculation none}"
  for rival in "${rivals[@]}"; do
    name=${rival%%=*}; read -ra rflags <<< "${rival#*=}"
    setsid nohup python3 -m mlx_relay.cli serve "$MODEL" --port 8101 "${caps[@]}" "${rflags[@]}" \
      > $O/rivals_$name.log 2>&1 < /dev/null &
    rival_pid=$!
    for _ in $(seq 1 600); do up http://127.0.0.1:8100/health && up http://127.0.0.1:8101/health && break
      alive $ours_pid $rival_pid || break; sleep 1; done  # a server that died at boot: its log says why
    pair=(--target ours=http://127.0.0.1:8100 --target "$name=http://127.0.0.1:8101" --scenario short_chat --no-plots)
    w=${WARM:-16:16}
    timeout -k 5 200 python3 -m mlx_relay.cli bench "${pair[@]}" --concurrency "${w%%:*}" --requests "${w##*:}" \
      --out /tmp/rivals-warm --seed 99 > /dev/null 2>&1
    for lv in ${RIVAL_LEVELS:-16:64 64:64}; do
      c=${lv%%:*}; n=${lv##*:}
      python3 -m mlx_relay.cli bench "${pair[@]}" --concurrency "$c" --requests "$n" --duration 400 \
        --out /tmp/rivals-$name-$c > $O/rivals_${name}_$c.txt 2>&1
      cp /tmp/rivals-$name-$c/bench.json $O/rivals_${name}_$c.json 2>/dev/null
      say "rivals $name c=$c: $(grep -h '^| ' $O/rivals_${name}_$c.txt | head -n 4 | cut -c1-200 | tr '\n' ';')"
    done
    kill -- -$rival_pid 2>/dev/null; kill $rival_pid 2>/dev/null; sleep 8
  done
  kill -- -$ours_pid 2>/dev/null; kill $ours_pid 2>/dev/null; sleep 8 ;;
vision)
  # issue 47.3: ours and mlx_vlm.server (APC on) side by side, each capped at MEM_GB, bench_vision_cache.py: a new
  # VISION_SIZE (1024) image cold, again in a new conversation, then the first conversation's next turn
  setsid nohup python3 -m mlx_relay.cli serve "$MODEL" --port 8100 --served-model-name qwen35-moe \
    --memory-limit-gb "${MEM_GB:-62}" --cache-limit-gb 4 > $O/vision_ours.log 2>&1 < /dev/null &
  ours_pid=$!
  APC_ENABLED=1 APC_DISK_ENABLED=0 setsid nohup python3 benchmarks/gpu/mlx_vlm_server_capped.py "${MEM_GB:-62}" 4 \
    -- --model "$MODEL" --host 127.0.0.1 --port 8101 > $O/vision_peer.log 2>&1 < /dev/null &
  peer_pid=$!
  up() { python3 -c "import sys,httpx; sys.exit(httpx.get(sys.argv[1],timeout=2).status_code!=200)" "$1" 2>/dev/null; }
  for _ in $(seq 1 600); do up http://127.0.0.1:8100/health && up http://127.0.0.1:8101/v1/models && break
    alive $ours_pid $peer_pid || break; sleep 1; done
  python3 benchmarks/bench_vision_cache.py --target ours=http://127.0.0.1:8100 --target mlx_vlm=http://127.0.0.1:8101 \
    --video-as-file mlx_vlm \
    --size "${VISION_SIZE:-1024}" --media "${VISION_MEDIA:-both}" --repeats "${REPEATS:-3}" --commit "$COMMIT" \
    --out $O/vision_cache.json \
    > $O/vision_cache.txt 2>&1
  say "vision (rc $?): $(grep -h '^| [a-z]' $O/vision_cache.txt | cut -c1-120 | tr '\n' ';')"
  kill -- -$ours_pid -$peer_pid 2>/dev/null; kill $ours_pid $peer_pid 2>/dev/null; sleep 8 ;;
embed)
  # issue 47.1: a random Qwen3-Embedding-0.6B-shaped model beside ours (--embedding-model), the probe:
  # STREAMS short_chat streams' ITL alone and beside EMBED_CLIENTS clients sending EMBED_INPUTS inputs of
  # EMBED_TOKENS tokens back to back, and the embeddings' rate alone and beside
  python3 benchmarks/gpu/build_embedding_model.py /root/embed --tokenizer "$TOK" $([ "$LOCAL" = 1 ] && echo --tiny) \
    > $O/build_embed.txt 2>&1
  setsid nohup python3 -m mlx_relay.cli serve "$MODEL" --port 8100 --served-model-name qwen35-moe \
    --embedding-model /root/embed --embedding-model-name embed > $O/embed_ours.log 2>&1 < /dev/null &
  ours_pid=$!
  for _ in $(seq 1 900); do python3 -c "import sys,httpx; sys.exit(httpx.get('http://127.0.0.1:8100/health',timeout=2).status_code!=200)" 2>/dev/null && break
    alive $ours_pid || break; sleep 1; done
  python3 benchmarks/probe_embeddings_beside_streams.py http://127.0.0.1:8100 --embed-model embed \
    --streams "${STREAMS:-8}" --clients "${EMBED_CLIENTS:-2}" --inputs "${EMBED_INPUTS:-32}" \
    --input-tokens "${EMBED_TOKENS:-512}" --vocab "${EMBED_VOCAB:-150000}" --window "${WINDOW:-20}" \
    --json $O/embed_probe.json > $O/embed_probe.txt 2>&1
  say "embed (rc $?): $(tail -n 1 $O/embed_probe.txt)"
  kill -- -$ours_pid 2>/dev/null; kill $ours_pid 2>/dev/null; sleep 8; rm -rf /root/embed ;;
snapio)
  python3 benchmarks/bench_snapshot_io.py --tokens 8192 --out $O/snapshot_io.json > $O/snapshot_io.txt 2>&1
  say "snapio done (rc $?)" ;;
*) say "unknown job $job" ;;
esac; done
touch $RUN/done
EOS
rm -f $RUN/done $RUN/progress.txt
cd $RUN/src
setsid nohup env RUN="$RUN" MODEL="${MODEL:-}" PYTHONPATH="$RUN/src:${PYTHONPATH:-}" BATCH="${BATCH:-}" BLOCK="${BLOCK:-}" \
  MTP_TOKENS="${MTP_TOKENS:-}" STEPS="${STEPS:-}" REPEATS="${REPEATS:-}" AGREE="${AGREE:-}" \
  JOBS="$JOBS" LOCAL="${LOCAL:-0}" ROUNDS="${ROUNDS:-}" DISK_REPEATS="${DISK_REPEATS:-}" COPY="${COPY:-}" \
  SPEC_TOKENS="${SPEC_TOKENS:-}" MAX_DRAFT="${MAX_DRAFT:-}" SWAPS="${SWAPS:-}" POOL_BUDGET="${POOL_BUDGET:-}" \
  POOL_TOKENS="${POOL_TOKENS:-}" POOL_FLAGS="${POOL_FLAGS:-}" COMMIT="${COMMIT:-}" \
  CLIENTS="${CLIENTS:-}" CLIENT_REQUESTS="${CLIENT_REQUESTS:-}" PREFILL_SIZES="${PREFILL_SIZES:-}" \
  PREFILL_CACHED="${PREFILL_CACHED:-}" PREFILL_ORDER="${PREFILL_ORDER:-}" PREFILL_FLAGS="${PREFILL_FLAGS:-}" PREFILL_TARGETS="${PREFILL_TARGETS:-}" \
  QMM_FLAGS="${QMM_FLAGS:-}" BLOCK_CHUNKS="${BLOCK_CHUNKS:-}" OVERLAP_CHUNKS="${OVERLAP_CHUNKS:-}" OVERLAP_PROMPT="${OVERLAP_PROMPT:-}" OVERLAP_EVERY="${OVERLAP_EVERY:-}" PARTS_CHUNK="${PARTS_CHUNK:-}" EXPLICIT_SLICES="${EXPLICIT_SLICES:-}" MIXED_ROWS="${MIXED_ROWS:-}" MIXED_CONTEXT="${MIXED_CONTEXT:-}" PARTS_CONTEXT="${PARTS_CONTEXT:-}" AGREE_DIR="${AGREE_DIR:-/root/agree-model}" TOK="${TOK:-/root/tok}" BUILD_FLAGS="${BUILD_FLAGS:-}" \
  bash $RUN/run.sh > $RUN/run.log 2>&1 &
echo "steps started (pid $!)"
