#!/usr/bin/env bash
# compile-oldest-torch.sh — compiles actmem against the oldest PyTorch of the supported range
# (2.11, the GPU machine's), beside the pinned one, on a machine without a GPU: downloads that
# wheel once into /opt/actmem/dl (~530 MB), unpacks its headers, CMake files and libraries into
# /opt/actmem/torch-<version>, configures build-torch-<version>/ against it and builds every
# library, program and test, CUDA translation units included, linked against that libtorch. With
# --test it then runs the whole suite on that libtorch (CPU), borrowing the NVIDIA libraries the
# programs load but never call from the pinned wheel's virtual environment. Not part of CI (the
# build takes 3-10 minutes on 2 cores, the suite another 9-12).
# Usage: scripts/compile-oldest-torch.sh [VERSION (default 2.11.0)] [--test]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
version=2.11.0 test=0
for a in "$@"; do
  case "$a" in
    --test) test=1 ;;
    *) version="$a" ;;
  esac
done
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
# The wheel's CUDA libraries name others (cuSPARSELt, NVSHMEM) that live in other wheels; the
# programs link without them and are not run.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD=ON \
  -DCMAKE_PREFIX_PATH="$prefix/torch/share/cmake;$prefix/torch" -DACTMEM_PYTHON="$ACTMEM_PYTHON" \
  -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined | grep "actmem:"
ninja -C "$build" -j "$(nproc)"
echo "compile check against torch $version: every target built and linked"
if ((test)); then
  nv="$("$ACTMEM_PYTHON" -c 'import nvidia; print(list(nvidia.__path__)[0])')"
  LD_LIBRARY_PATH="$(printf '%s:' "$nv"/*/lib)${LD_LIBRARY_PATH:-}" \
    ctest --test-dir "$build" -j "$(nproc)" --output-on-failure
  echo "the test suite passed on torch $version"
fi
