#!/usr/bin/env bash
# gpu-deps.sh — run on the development machine (Debian 12 with the project's packages
# installed): copies the dependencies a GPU machine without internet lacks into .gpu-deps/,
# which git ignores: CLI11 and nlohmann-json (headers), GoogleTest (sources), Gloo's headers
# (c10d's ProcessGroupGloo.hpp includes them; the PyTorch wheel ships c10d's headers, not
# Gloo's) and SentencePiece (headers and its two libraries, which need only the C++ runtime). Copy the
# working tree to the GPU machine together with .gpu-deps/, then run scripts/gpu-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu-deps
mkdir -p .gpu-deps/include .gpu-deps/share/cmake
mkdir -p .gpu-deps/lib
cp -r /usr/include/CLI /usr/include/nlohmann /usr/include/gloo .gpu-deps/include/
cp /usr/include/sentencepiece_processor.h /usr/include/sentencepiece_trainer.h .gpu-deps/include/
cp -P /usr/lib/x86_64-linux-gnu/libsentencepiece.so* /usr/lib/x86_64-linux-gnu/libsentencepiece_train.so* \
  .gpu-deps/lib/
cp -r /usr/share/cmake/CLI11 /usr/share/cmake/nlohmann_json .gpu-deps/share/cmake/
cp -r /usr/src/googletest .gpu-deps/googletest
grep -qx '/.gpu-deps/' .git/info/exclude 2>/dev/null || echo '/.gpu-deps/' >> .git/info/exclude
du -sh .gpu-deps
