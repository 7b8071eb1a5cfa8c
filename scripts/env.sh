# env.sh — sourced by the scripts: where the PyTorch wheel lives and how CMake finds it.
# ACTMEM_VENV       the virtual environment holding torch, numpy, cmake and ninja
#                   (default /opt/actmem/venv: outside every clone, shared by all of them)
# ACTMEM_TORCH_VERSION  the torch the set-up installs and the build expects
ACTMEM_VENV="${ACTMEM_VENV:-/opt/actmem/venv}"
ACTMEM_TORCH_VERSION="${ACTMEM_TORCH_VERSION:-2.15.0}"
ACTMEM_PYTHON="$ACTMEM_VENV/bin/python"
# The venv's cmake, ctest and ninja first (Debian's CMake 3.25 does not read CUDA 13's layout).
export PATH="$ACTMEM_VENV/bin:$PATH"
_actmem_torch_dir="$ACTMEM_VENV/lib/python3.11/site-packages/torch"
if [[ -x "$ACTMEM_PYTHON" ]]; then
  _actmem_torch_dir="$("$ACTMEM_PYTHON" -c 'import os, sysconfig; print(os.path.join(sysconfig.get_paths()["purelib"], "torch"))')"
fi
# torch/share/cmake for TorchConfig.cmake, torch/ itself so that its lib/ is searched before
# the system's (a Debian libtorch on the machine must not be picked up), and the venv's Python
# for the tests that run Python (numpy's shuffle, torch.load of our checkpoints).
ACTMEM_TORCH_CMAKE_ARGS="-DCMAKE_PREFIX_PATH=$_actmem_torch_dir/share/cmake;$_actmem_torch_dir -DACTMEM_PYTHON=$ACTMEM_PYTHON"
