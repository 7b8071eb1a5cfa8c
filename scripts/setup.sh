#!/usr/bin/env bash
# setup.sh — make this Debian 12 machine able to build actmem, then configure and build it.
#
# Installs whatever is missing with apt-get (as root, or through sudo), configures build/ with
# CMake and builds with all cores. Safe to run again: it installs nothing that is present and
# rebuilds only what changed. Environment:
#   ACTMEM_BUILD_DIR   build directory (default: build)
#   ACTMEM_CMAKE_ARGS  extra CMake arguments (e.g. -DCMAKE_PREFIX_PATH=... for a CUDA libtorch)
#   ACTMEM_SKIP_APT=1  never call apt-get (for machines with libtorch from elsewhere)
#   ACTMEM_UNITY_BUILD=0  compile each source file on its own (default 1: a unity build, each
#                      batch of 8 files parsing libtorch's headers once; a clean build on 2 cores
#                      takes ~7 minutes instead of ~14, but an edit recompiles its whole batch)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${ACTMEM_BUILD_DIR:-$root/build}"

# libopenblas0-pthread: without it libtorch falls back to the reference BLAS (~14x slower matmuls).
# libgloo-dev: headers for c10d's Gloo process group.
# libsentencepiece-dev: the SentencePiece tokenizer and its trainer.
packages=(
  g++ make cmake
  libtorch-dev
  libopenblas0-pthread
  libgloo-dev
  libcli11-dev nlohmann-json3-dev libgtest-dev
  libsentencepiece-dev
)

if [[ "${ACTMEM_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    sudo=""
    if [[ $(id -u) -ne 0 ]]; then
      command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install ${missing[*]}" >&2; exit 1; }
      sudo="sudo"
    fi
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
fi

jobs="$(nproc 2>/dev/null || echo 2)"
unity=ON
[[ "${ACTMEM_UNITY_BUILD:-1}" == 0 ]] && unity=OFF
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD="$unity" \
  ${ACTMEM_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$jobs"
