#!/usr/bin/env bash
# setup.sh — make this Debian 12 machine able to build actmem, then configure and build it.
#
# libtorch comes from the PyPI `torch` wheel (its CUDA build: it runs CPU tensors without a GPU,
# and it ships libtorch's headers and CMake configuration), installed once into one virtual
# environment outside the clone, so every clone and every CI run on the machine reuses it. The
# first run downloads about 3 GB (torch and the NVIDIA libraries it depends on; 5.4 GB on disk).
# The other packages come from Debian (apt-get, as root or through sudo). Safe to run again: it
# installs nothing that is present and rebuilds only what changed. Environment:
#   ACTMEM_VENV          the virtual environment (default /opt/actmem/venv)
#   ACTMEM_TORCH_VERSION the pinned torch (default below; 2.11 to 2.15 are supported)
#   ACTMEM_BUILD_DIR     build directory (default: build)
#   ACTMEM_CMAKE_ARGS    extra CMake arguments
#   ACTMEM_SKIP_APT=1    never call apt-get (for machines set up by hand)
#   ACTMEM_UNITY_BUILD=0 compile each source file on its own (default 1: a unity build, each batch
#                        of 8 files parsing libtorch's headers once)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$root/scripts/env.sh"
build="${ACTMEM_BUILD_DIR:-$root/build}"

# libgloo-dev: the headers of c10d's Gloo process group (the wheel has c10d's, not gloo's).
# libsentencepiece-dev: the SentencePiece tokenizer and its trainer (a helper process).
# python3-venv: the virtual environment the wheel lives in.
packages=(
  g++ make python3-venv
  libgloo-dev
  libcli11-dev nlohmann-json3-dev libgtest-dev
  libsentencepiece-dev
)

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
if [[ "${ACTMEM_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    [[ -z "$sudo" ]] || command -v sudo >/dev/null ||
      { echo "setup: need root (or sudo) to install ${missing[*]}" >&2; exit 1; }
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
fi

# The wheel, once per machine.
torch_version() { "$ACTMEM_PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null; }
have="$(torch_version || true)"
if [[ "$have" != "$ACTMEM_TORCH_VERSION" ]]; then
  parent="$(dirname "$ACTMEM_VENV")"
  $sudo mkdir -p "$parent"
  need_kib=$((9 * 1024 * 1024))  # 5.4 GB installed plus the downloads while they unpack
  free_kib=$(df -Pk "$parent" | awk 'NR == 2 { print $4 }')
  if ((free_kib < need_kib)); then
    echo "setup: torch $ACTMEM_TORCH_VERSION needs about 9 GiB free in $parent for $ACTMEM_VENV;" \
         "$((free_kib / 1024 / 1024)) GiB are free (set ACTMEM_VENV to a larger disk)" >&2
    exit 1
  fi
  if [[ ! -x "$ACTMEM_PYTHON" ]]; then
    echo "setup: creating $ACTMEM_VENV"
    $sudo /usr/bin/python3 -m venv "$ACTMEM_VENV"
  fi
  echo "setup: installing torch $ACTMEM_TORCH_VERSION into $ACTMEM_VENV (first time: ~3 GB to download)"
  $sudo "$ACTMEM_PYTHON" -m pip install --disable-pip-version-check --progress-bar on \
    "torch==$ACTMEM_TORCH_VERSION" numpy cmake ninja
  have="$(torch_version || true)"
  [[ "$have" == "$ACTMEM_TORCH_VERSION" ]] ||
    { echo "setup: $ACTMEM_VENV has torch $have after the install, expected $ACTMEM_TORCH_VERSION" >&2; exit 1; }
fi

# TensorBoard's own event reader, for the test of --tensorboard-dir's files (no TensorFlow).
if ! "$ACTMEM_PYTHON" -c 'import tensorboard' >/dev/null 2>&1; then
  echo "setup: installing tensorboard into $ACTMEM_VENV (the tests read event files with it)"
  $sudo "$ACTMEM_PYTHON" -m pip install --disable-pip-version-check -q "tensorboard==2.21.0"
fi
# Hugging Face's byte-level BPE, for the tests of GPT2BPETokenizer (--vocab-file/--merge-file) and
# HuggingFaceTokenizer;
# its Python side needs none of its optional dependencies (no hub access in the tests).
if ! "$ACTMEM_PYTHON" -c 'import tokenizers' >/dev/null 2>&1; then
  echo "setup: installing tokenizers into $ACTMEM_VENV (the tests compare GPT-2 BPE with it)"
  $sudo "$ACTMEM_PYTHON" -m pip install --disable-pip-version-check -q --no-deps "tokenizers==0.23.3"
fi
# OpenAI's tiktoken, for the test of TikTokenizer (Megatron builds its tiktoken.Encoding from the
# vocabulary file; the encodings it would download are never used).
if ! "$ACTMEM_PYTHON" -c 'import tiktoken' >/dev/null 2>&1; then
  echo "setup: installing tiktoken into $ACTMEM_VENV (the tests compare TikTokenizer with it)"
  $sudo "$ACTMEM_PYTHON" -m pip install --disable-pip-version-check -q --no-deps "tiktoken==0.14.0"
fi

unity=ON
[[ "${ACTMEM_UNITY_BUILD:-1}" == 0 ]] && unity=OFF
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD="$unity" \
  $ACTMEM_TORCH_CMAKE_ARGS ${ACTMEM_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)"
