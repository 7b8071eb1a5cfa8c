#!/usr/bin/env bash
# gpu-check.sh — run ON THE GPU MACHINE (PyTorch with CUDA, CMake, ninja and nvcc installed; no
# internet needed), from the repository root, after copying the working tree there together with
# .gpu-deps/ (made by scripts/gpu-deps.sh). Builds actmem against the CUDA libtorch inside
# PyTorch for compute capability 9.0 (Hopper), runs the CUDA tests (the copy engine, CUDA offload
# exactness), short CUDA training runs with offload, then the whole test suite (last, under a time
# limit, so the CUDA results are written first). Logs, JSON and summary.txt go to the directory
# named by $OUT, or ./gpu-out when OUT is unset. The whole script is meant to finish within about
# 10 minutes on a 16-core machine.
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
J=$(nproc)
step() { echo "== $*" | tee -a "$OUT/summary.txt"; }

export PATH="/usr/local/cuda/bin:$PATH"
NVCC=$(command -v nvcc || true)
[ -n "$NVCC" ] || { step "no nvcc"; exit 1; }
export CUDACXX="$NVCC"
TORCH_CUDA=$(python3 -c 'import torch; print(torch.version.cuda or "")')
NVCC_CUDA=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
step "torch $(python3 -c 'import torch; print(torch.__version__)') CUDA $TORCH_CUDA, nvcc $NVCC_CUDA"
[ "${TORCH_CUDA%%.*}" = "${NVCC_CUDA%%.*}" ] || { step "nvcc major differs from torch's CUDA"; exit 1; }

step "GoogleTest from the carried sources"
cmake -S .gpu-deps/googletest -B /tmp/gtest-build -G Ninja -DCMAKE_INSTALL_PREFIX=/tmp/gtest \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF > "$OUT/gtest.log" 2>&1 &&
  cmake --build /tmp/gtest-build -j "$J" >> "$OUT/gtest.log" 2>&1 &&
  cmake --install /tmp/gtest-build >> "$OUT/gtest.log" 2>&1 || { step "gtest build FAILED"; exit 1; }

TORCH_PREFIX=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
step "configure"
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DACTMEM_BUILD_BENCH=OFF \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DTORCH_CUDA_ARCH_LIST=9.0 \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$PWD/.gpu-deps;/tmp/gtest" > "$OUT/configure.log" 2>&1 ||
  { step "configure FAILED"; tail -40 "$OUT/configure.log"; exit 1; }
grep -E "actmem:" "$OUT/configure.log" | tee -a "$OUT/summary.txt"
step "build"
cmake --build build-cuda -j "$J" > "$OUT/build.log" 2>&1 ||
  { step "build FAILED"; grep -m 30 -B2 -A6 "error" "$OUT/build.log"; exit 1; }

step "CUDA tests"
timeout 120 build-cuda/tests/actmem_tests --gtest_filter='Cuda*' 2>&1 | tee "$OUT/cuda-tests.log" | tail -20

step "CUDA training: plain, fine-grained offload, layer-level offload (4x512)"
M="--num-layers 4 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048 --seq-length 512 --micro-batch-size 4 --train-iters 6 --eval-interval 0 --log-interval 1 --device cuda"
timeout 60 build-cuda/actmem train $M --log-json "$OUT/plain.jsonl" > "$OUT/train-plain.log" 2>&1
timeout 60 build-cuda/actmem train $M --fine-grained-activation-offloading \
  --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm \
  --log-json "$OUT/fine.jsonl" --trace "$OUT/fine-trace.json" > "$OUT/train-fine.log" 2>&1
timeout 60 build-cuda/actmem train $M --cpu-offloading-num-layers 2 --log-json "$OUT/layer.jsonl" \
  > "$OUT/train-layer.log" 2>&1
for f in plain fine layer; do
  python3 - "$OUT/$f.jsonl" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
last = rows[-1]
print(sys.argv[1].split('/')[-1], "loss", [round(r["loss"], 6) for r in rows],
      "digest", last["grad_digest"][:12], "act MiB", round(last["activation_bytes"] / 2**20, 1),
      "peak MiB", round(last["peak_device_bytes"] / 2**20, 1),
      "offloaded MiB", round(last["offloaded_bytes"] / 2**20, 1),
      "wait s", round(last["offload_wait_s"], 4),
      "step s", round(sorted(r["step_time_s"] for r in rows[1:])[len(rows[1:]) // 2], 4))
PY
done

step "whole suite (ctest, at most 200 s)"
(cd build-cuda && timeout 200 ctest -j "$J" --timeout 120 > "$OUT/ctest.log" 2>&1)
grep -E "tests passed|\*\*\*Failed|Timeout" "$OUT/ctest.log" | tee -a "$OUT/summary.txt"
step "done"
