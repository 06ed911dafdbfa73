#!/usr/bin/env bash
# Before a GPU session (benchmarks/gpu_session.sh): the wheels the offline H200 machine lacks,
# for its Python 3.12, into .whl/ (git-ignored; `carry` it). That is transformers at this
# machine's version and the packages that version needs newer than the device image has
# (huggingface_hub 2.x and its httpx2 stack, kernels, ...): transformers checks their versions
# when it is imported. Run from the venv that has megatrain installed (PY=python there).
# DeepSpeed, for benchmarks/peers.py's ZeRO-3 offload row, goes to .whl/ds/ (installed on the
# device into its own folder, which only that row puts on its path, after the image's packages):
# its sdist (it publishes no wheel; its ops are built at run time) and the small dependencies
# the image may lack. All of .whl/ must stay under the 64 MiB a `carry` moves.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
pins=$($PY - <<'PY'
from importlib.metadata import version
names = ["transformers", "huggingface_hub", "httpx2", "httpcore2", "truststore", "hf-xet", "kernels",
         "tomlkit", "regex", "click", "filelock", "fsspec", "tokenizers"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
mkdir -p .whl/ds
python3 -m pip download -q --no-deps --no-binary deepspeed --no-build-isolation -d .whl/ds deepspeed
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/ds \
  hjson msgpack einops py-cpuinfo nvidia-ml-py pydantic pydantic-core annotated-types typing-inspection \
  typing-extensions psutil packaging numpy
ls -la .whl .whl/ds
size=$(du -sm .whl | cut -f1)
echo ".whl: ${size} MiB (the carry limit is 64 MiB)"
[ "$size" -lt 64 ] || { echo "gpu_prepare: .whl is over the carry limit" >&2; exit 1; }
