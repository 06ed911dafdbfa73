#!/usr/bin/env bash
# One prepared run for a lent GPU machine (the `device` tool; about 10 minutes of wall time).
#
# The H200 machine is offline, runs Python 3.12 as `python3` and has torch, triton, pytest,
# hypothesis, networkx, safetensors, PyYAML, tqdm and ninja, but an older transformers. So:
#   here:   bash benchmarks/gpu_prepare.sh          # transformers wheel (this machine's version) -> .whl/
#   device: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
# It installs the package without touching the machine's CUDA torch (no index, no build
# isolation), measures megatrain's step against the GPU-resident limit first (the figure two
# earlier sessions did not get), then the kernel speeds, the CUDA tests and the kernel tests;
# everything goes to $OUT (or ./gpu-out). A step cut short by its timeout prints every thread's
# stack first (SIGUSR1 -> faulthandler), so a hang says where it was.
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
# the host AdamW kernel is built once per machine (cached): not inside a timed first step
timeout 90 $PY -c "from megacompile.runtime.adamw import kernel; import time; t=time.time(); k=kernel(); \
print('host adamw kernel', k is not None, f'{time.time()-t:.1f} s')" > "$OUT/adamw_build.txt" 2>&1
# segment attention's CUDA kernels and the host checkpoints first (never run on a GPU before this
# stop): if they fail, the step below measures with transformers' attention instead
timeout 90 $PY -m pytest tests/test_cuda.py -k "segment or long_context" -q --tb=short -rf -p no:cacheprovider \
  > "$OUT/tests_long_context.txt" 2>&1
LC=$?; echo "long-context cuda tests rc=$LC" >> "$OUT/tests_long_context.txt"
ATTN=segments; [ $LC -eq 0 ] || ATTN=transformers
# (lowering eager: the first H200 session saw no megatrain warm-up within 160 s with "auto", which
# compiles every distinct body with Inductor first; eager gives the transfer/overlap figures in time)
timeout -s USR1 -k 15 230 $PY benchmarks/overlap.py --layers 8 --steps 3 --warmup 1 --lowering eager \
  --attention $ATTN --only "limit,megatrain,megatrain +overlap bwd,megatrain plain,megatrain +overlap fwd" \
  > "$OUT/overlap.txt" 2>&1
echo "overlap rc=$?" >> "$OUT/overlap.txt"
timeout 60 $PY benchmarks/kernel_speed.py > "$OUT/kernel_speed.txt" 2>&1; echo "kernels rc=$?" >> "$OUT/kernel_speed.txt"
# (these include bf16/fp16 gradient accumulation over micro-batches of new lengths, issue 28)
timeout 100 $PY -m pytest tests/test_cuda.py -k "not segment and not long_context" -q --tb=short -rf --maxfail=5 \
  -p no:cacheprovider \
  > "$OUT/tests_cuda.txt" 2>&1; echo "cuda tests rc=$?" >> "$OUT/tests_cuda.txt"
timeout 40 $PY -m pytest tests/test_kernels.py -k "rms" -q --tb=short -rf -p no:cacheprovider \
  > "$OUT/tests_kernels.txt" 2>&1; echo "kernel tests rc=$?" >> "$OUT/tests_kernels.txt"
tail -n 30 "$OUT"/*.txt
