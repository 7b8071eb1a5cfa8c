#!/usr/bin/env bash
# gpu-deps.sh — run on the development machine (Debian 12 with the project's packages
# installed): copies the header-only and source dependencies a GPU machine without internet
# lacks (CLI11, nlohmann-json, GoogleTest sources) into .gpu-deps/, which git ignores. Copy the
# working tree to the GPU machine together with .gpu-deps/, then run scripts/gpu-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu-deps
mkdir -p .gpu-deps/include .gpu-deps/share/cmake
cp -r /usr/include/CLI /usr/include/nlohmann .gpu-deps/include/
cp -r /usr/share/cmake/CLI11 /usr/share/cmake/nlohmann_json .gpu-deps/share/cmake/
cp -r /usr/src/googletest .gpu-deps/googletest
grep -qx '/.gpu-deps/' .git/info/exclude 2>/dev/null || echo '/.gpu-deps/' >> .git/info/exclude
du -sh .gpu-deps
