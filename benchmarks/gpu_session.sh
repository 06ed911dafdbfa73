#!/usr/bin/env bash
# One prepared run for a lent GPU machine (the `device` tool: ~10 minutes of wall time).
# Installs the package without touching the machine's CUDA torch, runs the CUDA tests, the
# Triton kernel tests on the GPU, then the benchmarks; everything goes to $OUT (or ./gpu-out).
#   bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$OUT/env.txt" 2>&1
pip install -q --no-deps -e . > "$OUT/install.txt" 2>&1
pip install -q hypothesis safetensors pyyaml networkx tqdm ninja >> "$OUT/install.txt" 2>&1
timeout 150 python -m pytest tests/test_cuda.py tests/test_kernels.py tests/test_kernels_linear_ce.py -q -x \
  > "$OUT/tests.txt" 2>&1; echo "tests rc=$?" >> "$OUT/tests.txt"
timeout 60 python benchmarks/cpu_adam.py --params 256e6 > "$OUT/cpu_adam.txt" 2>&1
timeout 360 python -u benchmarks/overlap.py --steps 4 --warmup 2 > "$OUT/overlap.txt" 2>&1
echo "overlap rc=$?" >> "$OUT/overlap.txt"
tail -n 3 "$OUT"/*.txt
