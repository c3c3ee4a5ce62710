#!/usr/bin/env bash
# A virtualenv with the real PyTorch (2.11, its CUDA 13 build from PyPI) for the tests of the
# PyTorch integration on a machine without a GPU: install() and the native allocator run inside
# a real PyTorch process, served by gpumem's simulated device (tests/python/test_torch_install.py).
#
# Usage, from the repository root:
#     bash scripts/torch_env.sh VENV
# Makes VENV (if it is not there), installs PyTorch, ninja, pytest, numpy and the two CUDA 13 header
# packages that PyTorch's wheels leave out (crt/ and nvcc's headers, which
# torch.utils.cpp_extension needs to compile the native allocator), and a CUDA_HOME for
# cpp_extension at VENV/cuda_home: the pip packages' headers and a libcudart.so to link against.
# About 5 GB on disk; a few minutes, most of it the download. Prints the CUDA_HOME last.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:?usage: torch_env.sh VENV}
TORCH_VERSION=2.11.0
CUDA_HEADERS_VERSION=13.0.88

[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
# A stalled download must not hold the caller for long: pip gives up on a silent connection,
# and the whole install on a slow one.
timeout 1500 "$VENV/bin/python" -m pip install --quiet --timeout 60 --retries 2 \
    "torch==$TORCH_VERSION" ninja pytest numpy \
    "nvidia-cuda-crt==$CUDA_HEADERS_VERSION" "nvidia-cuda-nvcc==$CUDA_HEADERS_VERSION"

site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cu="$site/nvidia/cu13"
[[ -f "$cu/include/cuda_runtime_api.h" && -d "$cu/include/crt" ]] || {
    echo "torch_env.sh: no CUDA 13 headers under $cu/include" >&2
    exit 1
}
cudart=$(ls "$cu"/lib/libcudart.so.13* 2>/dev/null | head -1)
[[ -n "$cudart" ]] || { echo "torch_env.sh: no libcudart.so.13 under $cu/lib" >&2; exit 1; }
home="$VENV/cuda_home"
mkdir -p "$home/lib64"
ln -sfn "$cu/include" "$home/include"
ln -sf "$cudart" "$home/lib64/libcudart.so"
echo "$(cd "$home" && pwd)"
