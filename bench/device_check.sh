#!/usr/bin/env bash
# The GPU measurements for BENCHMARKS.md, run on the lent accelerator machine:
#   bash bench/device_check.sh        single-device step time and MFU of the default model
#   bash bench/device_check.sh mfu    MFU of the ~125M and ~350M Llama presets (bench/mfu.py),
#                                     bfloat16, flax_tp against plain Flax at 1x1
# Results and logs go to $OUT (default /tmp), with the device's jax / flax versions.
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
if [ "${1:-}" = mfu ]; then
  python3 -m bench.mfu --points "${POINTS:-16x1024,32x1024}" --remat "${REMAT:-block}" \
    --repeats 10 --out "${OUT:-/tmp}/mfu_gpu.json" 2>&1 | tee "${OUT:-/tmp}/mfu.log"
else
  python3 bench/run.py --skip audit,peers,memory,hostmem,scaling --meshes 1x1 --repeats 20 \
    --out "${OUT:-/tmp}/results_gpu.json" 2>&1 | tee "${OUT:-/tmp}/gpu.log"
fi
