#!/usr/bin/env bash
# Does the front end's process open a CUDA context, and can it be kept from doing so? (The server's
# own process held 518 MiB of an H200 beside its engine process: benchmarks/results/gpu-h200-2026-11-25/.)
# Each case runs in a fresh interpreter that sleeps while nvidia-smi lists the compute processes.
#   bash benchmarks/gpu/front_end_context_probe.sh      # carry [".device-kit/part2"] after the part1 call
source .device-kit/part2/setup.sh > /dev/null
probe() {  # label, env assignment (or -), python code
  local label=$1 envs=$2 code=$3
  if [ "$envs" = - ]; then python3 -c "$code; import time; time.sleep(4)" > /tmp/probe.out 2>&1 &
  else env "$envs" python3 -c "$code; import time; time.sleep(4)" > /tmp/probe.out 2>&1 & fi
  local pid=$!; sleep 3
  local mib; mib=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | grep "^$pid," | cut -d, -f2)
  wait $pid; local rc=$?
  echo "$label: rc $rc, device memory ${mib:- none} | $(tail -c 160 /tmp/probe.out | tr '\n' ' ')"
}
probe "import mlx.core" - "import mlx.core as mx"
probe "import mlx_lm" - "import mlx_lm"
probe "import mlx_vlm" - "import mlx_vlm"
probe "cpu default, import mlx_vlm" - "import mlx.core as mx; mx.set_default_device(mx.cpu); import mlx_vlm"
probe "no visible device, import mlx_vlm" CUDA_VISIBLE_DEVICES= "import mlx_vlm; print('imported')"
probe "no visible device, cpu default, an array" CUDA_VISIBLE_DEVICES= "import mlx.core as mx; mx.set_default_device(mx.cpu); print(mx.array([1,2]).sum().item())"
