# Sourced at the start of every GPU call (benchmarks/gpu/README.md): MLX's CUDA kit, the extra
# wheels stashed by the first call, the repo on PYTHONPATH, the tokenizer unpacked.
set -euo pipefail
source .device-kit/part2/setup.sh
if [ ! -f /tmp/site/.extra-wheels-v7 ]; then
  # every non-MLX wheel once: the stash's, plus those of .device-kit/extra the stash lacks (a wheel
  # named twice stops pip); the marker is written only when pip succeeded
  shopt -s nullglob
  wheels=(/root/stash/wheels/*.whl)
  for w in .device-kit/extra/*.whl; do [ -f "/root/stash/wheels/$(basename "$w")" ] || wheels+=("$w"); done
  shopt -u nullglob
  # (none when every wheel travels in part2 itself: setup.sh installed them)
  if [ ${#wheels[@]} -eq 0 ]; then touch /tmp/site/.extra-wheels-v7; else
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}" \
      && touch /tmp/site/.extra-wheels-v7 || { echo "device_env.sh: installing the wheels failed" >&2; return 1; }
  fi
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MLX_RELAY_CACHE=/root/mlx-relay-cache
MODEL=${MODEL:-/root/qwen35-35b-a3b-random-8bit}  # a MODEL the caller set (the --mtp-agree build) stays
if [ ! -f /root/tok/tokenizer.json ]; then mkdir -p /root/tok && tar xJf .device-carry/tokenizer.tar.xz -C /root/tok; fi
# (the stash call can unpack it instead, so later calls need not carry .device-carry)
# MLX's kernel cache from an earlier machine (device_matrix.sh brings it back), carried as
# .device-kit/ptx/ptx-cache.tar.xz.NN: the first server start then skips minutes of NVRTC builds
if [ ! -d /tmp/mlx ] && compgen -G ".device-kit/ptx/ptx-cache.tar.xz.*" > /dev/null; then
  cat .device-kit/ptx/ptx-cache.tar.xz.* | tar xJf - -C /tmp
fi
