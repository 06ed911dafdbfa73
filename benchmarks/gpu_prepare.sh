#!/usr/bin/env bash
# Before a GPU session (benchmarks/gpu_session.sh): the wheels the offline H200 machine lacks,
# for its Python 3.12, into .whl/ (git-ignored; `carry` it). Today that is transformers at this
# machine's version (the device image's is older; its dependencies are all there).
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(python3 -c "import transformers; print(transformers.__version__)")
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "transformers==$version"
ls -la .whl
