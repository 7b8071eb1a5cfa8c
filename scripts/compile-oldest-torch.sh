#!/usr/bin/env bash
# compile-oldest-torch.sh — compiles actmem against the oldest PyTorch of the supported range
# (2.11, the GPU machine's), beside the pinned one, on a machine without a GPU: downloads that
# wheel once into /opt/actmem/dl (~530 MB), unpacks its headers, CMake files and libraries into
# /opt/actmem/torch-<version>, configures build-torch-<version>/ against it and compiles every
# library and every object of the programs and tests, CUDA translation units included. It does
# not link the programs (their CUDA dependencies live in other wheels) and runs nothing: it
# checks that the sources build on the oldest headers. Not part of CI (it takes ~10 minutes).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
version="${1:-2.11.0}"
dl=/opt/actmem/dl
prefix="/opt/actmem/torch-$version"
build="build-torch-$version"
mkdir -p "$dl"
wheel=$(ls "$dl"/torch-"$version"-*.whl 2>/dev/null | head -1 || true)
if [[ -z "$wheel" ]]; then
  "$ACTMEM_PYTHON" -m pip download --disable-pip-version-check --no-deps "torch==$version" -d "$dl"
  wheel=$(ls "$dl"/torch-"$version"-*.whl | head -1)
fi
if [[ ! -f "$prefix/torch/version.py" ]]; then
  mkdir -p "$prefix"
  "$ACTMEM_PYTHON" - "$wheel" "$prefix" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist()
                               if n.startswith(("torch/include/", "torch/share/", "torch/lib/"))
                               or n == "torch/version.py"])
PY
fi
echo "compile check against $(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$prefix/torch/version.py")"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD=ON \
  -DCMAKE_PREFIX_PATH="$prefix/torch/share/cmake;$prefix/torch" -DACTMEM_PYTHON="$ACTMEM_PYTHON" \
  | grep "actmem:"
# Every object file of every target (ninja's per-directory "all objects" is not a target, so
# list them), then the static libraries.
objects=$(ninja -C "$build" -t targets all | sed -n 's/^\(.*\.o\): .*/\1/p')
# shellcheck disable=SC2086
ninja -C "$build" -j "$(nproc)" $objects actmem_core actmem_model actmem_flags
echo "compile check against torch $version: every object built"
