#!/usr/bin/env bash
# The GPU measurements for BENCHMARKS.md, run on the lent accelerator machine:
# single-device step time and model FLOP utilisation of the default model.
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
python3 bench/run.py --skip audit,peers,memory,hostmem,scaling --meshes 1x1 --repeats 20 \
  --out "${OUT:-/tmp}/results_gpu.json" 2>&1 | tee "${OUT:-/tmp}/gpu.log"
