#!/usr/bin/env bash
# One prepared run for a lent GPU machine (the `device` tool; about 10 minutes of wall time).
#
# The H200 machine is offline, runs Python 3.12 as `python3` and has torch, triton, pytest,
# hypothesis, networkx, safetensors, PyYAML, tqdm and ninja, but an older transformers. So:
#   here:   bash benchmarks/gpu_prepare.sh          # transformers wheel (this machine's version) -> .whl/
#   device: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
# It installs the package without touching the machine's CUDA torch (no index, no build
# isolation), runs the CUDA tests, the Triton kernel tests on the GPU, then the benchmarks;
# everything goes to $OUT (or ./gpu-out).
set -u
OUT=${OUT:-gpu-out}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/install.txt" 2>&1 && export PYTHONPATH=/tmp/site
  # (if the carried transformers does not import there, fall back to the image's own)
  $PY -c "import transformers" >> "$OUT/install.txt" 2>&1 || { echo "carried transformers fails; image's used" \
    >> "$OUT/install.txt"; unset PYTHONPATH; }
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$OUT/install.txt" 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # (megacompile importable even if the editable install fails)
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  $PY -c "import megacompile; print('megacompile from', megacompile.__file__)"
} > "$OUT/env.txt" 2>&1
timeout 80 $PY -m pytest tests/test_kernels.py tests/test_kernels_linear_ce.py -q --tb=short -rf --maxfail=5 \
  -p no:cacheprovider > "$OUT/tests_kernels.txt" 2>&1; echo "kernel tests rc=$?" >> "$OUT/tests_kernels.txt"
timeout 110 $PY -m pytest tests/test_cuda.py -q --tb=short -rf --maxfail=5 -p no:cacheprovider \
  > "$OUT/tests_cuda.txt" 2>&1; echo "cuda tests rc=$?" >> "$OUT/tests_cuda.txt"
timeout 45 $PY benchmarks/cpu_adam.py --params 256e6 > "$OUT/cpu_adam.txt" 2>&1
timeout 75 $PY benchmarks/kernel_speed.py > "$OUT/kernel_speed.txt" 2>&1; echo "kernels rc=$?" >> "$OUT/kernel_speed.txt"
# (lowering eager: the first H200 session saw no megatrain warm-up within 160 s with "auto", which
# compiles every distinct body with Inductor first; eager gives the transfer/overlap figures in time)
timeout 250 $PY benchmarks/overlap.py --layers 8 --steps 3 --warmup 2 --lowering eager > "$OUT/overlap.txt" 2>&1
echo "overlap rc=$?" >> "$OUT/overlap.txt"
tail -n 25 "$OUT"/*.txt
