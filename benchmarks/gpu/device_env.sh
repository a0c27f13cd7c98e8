# Sourced at the start of every GPU call (benchmarks/gpu/README.md): MLX's CUDA kit, the extra
# wheels stashed by the first call, the repo on PYTHONPATH, the tokenizer unpacked.
set -euo pipefail
source .device-kit/part2/setup.sh
if [ ! -f /tmp/site/.extra-wheels-v5 ]; then
  shopt -s nullglob  # .device-kit/extra is optional (its wheels may be stashed with part1x instead)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/stash/wheels/*.whl \
    .device-kit/extra/*.whl
  shopt -u nullglob
  touch /tmp/site/.extra-wheels-v5
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MLX_RELAY_CACHE=/root/mlx-relay-cache
MODEL=/root/qwen35-35b-a3b-random-8bit
if [ ! -f /root/tok/tokenizer.json ]; then mkdir -p /root/tok && tar xJf .device-carry/tokenizer.tar.xz -C /root/tok; fi
# (the stash call can unpack it instead, so later calls need not carry .device-carry)
