#!/usr/bin/env bash
# One GPU session's checks, in one call (the device tool's machines start bare; weights do not travel, so the
# timings use random weights with SmolLM2's config and tokenizer: checkpoints/smollm2-135m-instruct/{config.json,
# tokenizer} must be present). Writes logs under ${OUT:-/tmp/gpu_out}. The steps' timeouts sum to 480 s: run it
# with a call limit above that (the first call on 2026-11-29 ran out at 560 s with longer steps).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi -L
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
echo "== bench/sweep.py (random weights)"
timeout 220 python3 bench/sweep.py --random-weights --contexts 8 --batch-size 8 --context-tokens 1000 \
  --methods kvzip,snapkv --ratios 0.5,0.3 2>&1 | grep -v Warning | tee "$OUT/sweep.log"
echo "== bench/kvzip.py (random weights)"
timeout 200 python3 bench/kvzip.py --random-weights --tokens 2048 4096 --repeats 1 2>&1 \
  | grep -v Warning | tee "$OUT/kvzip.log"
echo "== tests on the GPU (float32 matmuls at full precision)"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 60 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_kvzip_score.py 2>&1 | tee "$OUT/tests.log" | tail -5
