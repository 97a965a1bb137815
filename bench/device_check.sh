#!/usr/bin/env bash
# The accelerator measurements for BENCHMARKS.md §6, run on the lent machine (GPU or TPU):
#   bash bench/device_check.sh        single-device step time and MFU of the default model
#   bash bench/device_check.sh mfu    MFU of the ~125M and ~350M Llama presets (bench/mfu.py),
#                                     bfloat16, flax_tp beside the independent peer at 1x1
# Results and logs go to $OUT (default /tmp), with the device's jax / flax versions.
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
elif [ -d /opt/pypi/simple ] && ! python3 -c "import flax" 2>/dev/null; then
  # The TPU image: JAX is installed, flax and the rest come from the machine's own index,
  # appended to PYTHONPATH so that the machine's JAX stays first.
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target /tmp/site \
    "flax==0.12.8" "optax==0.2.8" orbax-checkpoint rich safetensors tokenizers \
    || PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target /tmp/site \
    flax optax orbax-checkpoint rich safetensors tokenizers
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
fi
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
if [ "${1:-}" = mfu ]; then
  # BENCHMARKS.md §6's table: flax_tp (attention auto: splash on a TPU, and XLA's) beside
  # the independent plain-JAX peer (bench/peer_llama.py, splash and XLA); more flags of
  # bench.mfu after "mfu" (e.g. --presets llama-350m --points 8x1024 --remat block)
  shift
  python3 -m bench.mfu --presets "${PRESETS:-llama-125m,llama-350m}" \
    --points "${POINTS:-8x1024,16x1024,4x2048}" --attention auto,xla --no-plain-flax \
    --repeats "${REPEATS:-8}" --out "${OUT:-/tmp}/mfu.json" "$@" 2>&1 | tee "${OUT:-/tmp}/mfu.log"
else
  python3 bench/run.py --skip audit,peers,memory,hostmem,scaling --meshes 1x1 --repeats 20 \
    --out "${OUT:-/tmp}/results_gpu.json" 2>&1 | tee "${OUT:-/tmp}/gpu.log"
fi
