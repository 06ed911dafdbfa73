#!/usr/bin/env bash
# One prepared run for a lent GPU machine (the `device` tool; about 10 minutes of wall time).
#
# The GPU machine is offline, runs Python 3.12 as `python3` and has torch, triton, pytest,
# hypothesis, networkx, safetensors, PyYAML, tqdm and ninja, but an older transformers. So:
#   here:   bash benchmarks/gpu_prepare.sh          # transformers + deepspeed wheels -> .whl/
#   device: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
#   here:   bash benchmarks/gpu_session.sh --dry-run   # every step at toy size on the CPU, into gpu-out/
# It installs the package without touching the machine's CUDA torch (no index, no build
# isolation); everything goes to $OUT (or ./gpu-out). Order (issue 36), most valuable first:
#   1. the headline table, benchmarks/peers.py at Llama-3-8B shapes, 16 layers (~18 B/param of
#      host RAM: ~82 GB of the 128 GiB), megatrain (lowering eager) beside the GPU-resident limit,
#      FSDP2 and DeepSpeed offload: 32K tokens as 8 x 4096, then 64K tokens, then one 32K sequence;
#   2. the CUDA tests of features never run on a GPU (segment attention, host checkpoints,
#      bf16/fp16 accumulation over micro-batches of new lengths);
#   3. the kernel tests; then, time permitting, megatrain with lowering auto and the kernel speeds.
# Every step has a hard timeout, cut to what is left of BUDGET (540 s) so the whole fits the
# device's 10 minutes; a step with too little time left is skipped and says so. A step cut
# short by its timeout prints every thread's stack first (SIGUSR1 -> faulthandler), so a hang
# says where it was; peers.py does the same per row, and keeps the rows that finished.
set -u
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-gpu-out}
PY=${PY:-python3}; [ $DRY = 1 ] && PY=${PY_DRY:-python}   # (dry run: the venv's python)
BUDGET=${BUDGET:-540}; [ $DRY = 1 ] && BUDGET=${BUDGET_DRY:-1500}   # (this CPU is slower than a GPU machine)
DS_SITE=${DS_SITE:-/tmp/ds-site}; [ $DRY = 1 ] && DS_SITE=/tmp/ds-site-dry
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $((START + BUDGET - $(date +%s))); }
# cap S [RESERVE]: S seconds, or what is left of the budget less RESERVE if that is shorter
cap() { local l=$(( $(left) - ${2:-0} )); if [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi; }
# step NAME S RESERVE -- CMD...: CMD under a hard timeout (cap S RESERVE) into $OUT/NAME.txt, or
# skipped; an argument @BUDGET@ becomes that timeout less 20 s (peers.py's --budget for its rows)
step() {
  local name=$1 t a; t=$(cap "$2" "$3"); shift 4
  if [ "$t" -lt 30 ]; then echo "skipped: ${t}s left of the session's budget" > "$OUT/$name.txt"; return; fi
  local cmd=(); for a in "$@"; do [ "$a" = @BUDGET@ ] && a=$((t - 20)); cmd+=("$a"); done
  timeout -s USR1 -k 15 "$t" "${cmd[@]}" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$? (timeout ${t}s, at $(( $(date +%s) - START ))s)" >> "$OUT/$name.txt"
}

if [ $DRY = 1 ]; then
  echo "dry run: nothing installed (the venv's megatrain); deepspeed into $DS_SITE" > "$OUT/install.txt"
else
  if ls .whl/*.whl > /dev/null 2>&1; then
    timeout 60 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl > "$OUT/install.txt" 2>&1 && export PYTHONPATH=/tmp/site
    # (if the carried transformers does not import there, fall back to the image's own)
    $PY -c "import transformers" >> "$OUT/install.txt" 2>&1 || { echo "carried transformers fails; image's used" \
      >> "$OUT/install.txt"; unset PYTHONPATH; }
  fi
  timeout 60 $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$OUT/install.txt" 2>&1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # (megacompile importable even if the editable install fails)
{
  [ $DRY = 1 ] || nvidia-smi --query-gpu=name,memory.total --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__, 'gpu', torch.cuda.is_available())"
  $PY -c "import megacompile; print('megacompile from', megacompile.__file__)"
  free -g | head -2; nproc
} > "$OUT/env.txt" 2>&1

# In the background while the first rows run (its compilers take host cores, not the GPU):
# deepspeed into its own folder (peers.py's deepspeed row appends it to sys.path, after the
# image's packages: only what the image lacks comes from there), then its CPU Adam built into
# the extension cache, so that peers.py's 20 s probe finds it built; it says why if it cannot.
# The sdist is pip-installed (no build isolation, no index); if that fails, its tree is used as is.
# Niced, with few compile jobs: it must not slow the rows measured meanwhile (its end time is
# logged, and peers.py logs each row's start and end, to check that it did not overlap them).
(
  export MAX_JOBS=4
  echo "start $(date +%T)"
  if ls .whl/ds/deepspeed-*.tar.gz > /dev/null 2>&1; then
    nice -n 10 timeout 120 $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
      --target "$DS_SITE" .whl/ds/deepspeed-*.tar.gz || { echo "sdist install failed: its tree used as is"; mkdir -p "$DS_SITE" &&
      tar xzf .whl/ds/deepspeed-*.tar.gz -C /tmp && cp -r /tmp/deepspeed-*/deepspeed "$DS_SITE/"; }
    timeout 60 $PY -m pip install -q --no-index --no-deps --no-compile --target "$DS_SITE" .whl/ds/*.whl 2> /dev/null ||
      for w in .whl/ds/*.whl; do timeout 30 $PY -m pip install -q --no-index --no-deps --no-compile \
        --target "$DS_SITE" "$w" 2> /dev/null || echo "not installed: $w"; done
    nice -n 10 timeout 240 $PY -c "import sys; sys.path.append('$DS_SITE'); import time; t = time.time(); import deepspeed
from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()
print('deepspeed', deepspeed.__version__, f'cpu_adam built in {time.time() - t:.0f} s')"
  else
    echo "no .whl/ds/deepspeed-*.tar.gz (run benchmarks/gpu_prepare.sh): the deepspeed row will say so"
  fi
  echo "end $(date +%T)"
) > "$OUT/deepspeed_install.txt" 2>&1 &
# the host AdamW kernel is built once per machine (cached): not inside a timed first step
timeout 120 $PY -c "from megacompile.runtime.adamw import kernel; import time; t=time.time(); k=kernel(); \
print('host adamw kernel', k is not None, f'{time.time()-t:.1f} s')" > "$OUT/adamw_build.txt" 2>&1 &

# 1. the headline table. megatrain with lowering eager: the first H200 session saw no warm-up
# within 160 s with "auto", which compiles every distinct body with Inductor first; eager gives
# the transfer/overlap figures in time ("auto" comes last). Segment attention's CUDA kernels
# have never run on a GPU: if a megatrain row fails with them, peers.py runs it again with the
# model's own attention and says "attention fallback"; the later tables then use that.
# Layers: 16 (4.54B parameters) where host RAM holds them at ~18 B/param with a fifth spare;
# fewer on a smaller host (Llama-3-8B shapes: 1.27B outside the layers, 0.218B per layer).
LAYERS=$(awk '/^MemTotal/ {n = int((0.8 * $2 * 1024 / 18 - 1.27e9) / 0.218e9); print (n > 16 ? 16 : (n < 1 ? 1 : n))}' \
  /proc/meminfo)
echo "layers: $LAYERS" >> "$OUT/env.txt"
DRYARG=(); [ $DRY = 1 ] && DRYARG=(--dry-run)
PEERS=($PY benchmarks/peers.py "${DRYARG[@]}" --layers "$LAYERS" --steps 2 --warmup 1 --lowering eager
       --deepspeed-site "$DS_SITE" --probe-timeout 20)
step peers_32k_8x4096 300 230 -- "${PEERS[@]}" --tokens 32768 --seq 4096 --budget @BUDGET@ \
  --rows limit,megatrain+bwd,fsdp2-offload,deepspeed-zero3-offload \
  --timeouts limit=70,megatrain+bwd=120,fsdp2-offload=90,deepspeed-zero3-offload=100
ATTN=segments; grep -q "^attention fallback" "$OUT/peers_32k_8x4096.txt" && ATTN=transformers
step peers_64k_16x4096 130 140 -- "${PEERS[@]}" --attention $ATTN --tokens 65536 --seq 4096 --budget @BUDGET@ \
  --rows megatrain+bwd,limit --timeouts megatrain+bwd=100,limit=60
step peers_32k_1x32768 80 130 -- "${PEERS[@]}" --attention $ATTN --tokens 32768 --seq 32768 --budget @BUDGET@ \
  --rows megatrain+bwd

# 2. the CUDA tests of features never run on a GPU: segment attention's kernels and the host
# checkpoints, then the rest (bf16/fp16 gradient accumulation over micro-batches of new lengths,
# issue 28; the optimizer during the backward)
PYTEST=($PY -m pytest -q --tb=short -rf -p no:cacheprovider)
step tests_long_context 70 70 -- "${PYTEST[@]}" tests/test_cuda.py -k "segment or long_context"
step tests_cuda 90 30 -- "${PYTEST[@]}" --maxfail=5 tests/test_cuda.py -k "not segment and not long_context"
# 3. the kernel tests
step tests_kernels 40 0 -- "${PYTEST[@]}" tests/test_kernels.py -k rms
# the host's own figures where the GPU trains (issue 36): memory bandwidth and the host AdamW
# kernel on the cores this process may use, its last line "host adamw: X GB/s, F of the measured
# memory bandwidth (B GB/s)"; then where the planner says the optimizer hides with this host
CA=(--params 256e6 --repeat 5); [ $DRY = 1 ] && CA=(--params 4e6 --repeat 2)
step cpu_adam 45 0 -- $PY benchmarks/cpu_adam.py "${CA[@]}"
step plan_crossover 40 0 -- $PY benchmarks/plan_accuracy.py --crossover
# time permitting: megatrain with lowering auto (Inductor bodies: the first step compiles them),
# megatrain with HostAdamW after the backward (its exposed optimizer time), the kernel speeds
step peers_auto 200 0 -- "${PEERS[@]}" --attention $ATTN --tokens 32768 --seq 4096 --lowering auto \
  --rows megatrain+bwd --budget @BUDGET@
step peers_opt_after_bwd 100 0 -- "${PEERS[@]}" --attention $ATTN --tokens 32768 --seq 4096 --rows megatrain \
  --budget @BUDGET@
KS=(); [ $DRY = 1 ] && KS=(--device cpu --tokens 64 --hidden 64 --ffn 128 --vocab 256 --repeat 1 --warmup 1)
step kernel_speed 60 0 -- $PY benchmarks/kernel_speed.py "${KS[@]}"
echo "session: $(( $(date +%s) - START )) s of a ${BUDGET} s budget" >> "$OUT/env.txt"
for f in "$OUT"/*.txt; do case $f in */peers_*) n=16 ;; *) n=4 ;; esac; echo "== $f"; tail -n $n "$f"; done
