#!/usr/bin/env bash
# Before a GPU session (benchmarks/gpu_session.sh): the wheels the offline H200 machine lacks,
# for its Python 3.12, into .whl/ (git-ignored; `carry` it). That is transformers at this
# machine's version and the packages that version needs newer than the device image has
# (huggingface_hub 2.x and its httpx2 stack, kernels, ...): transformers checks their versions
# when it is imported. Run from the venv that has megatrain installed (PY=python there).
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
ls -la .whl
