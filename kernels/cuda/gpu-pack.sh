#!/bin/sh
# gpu-pack.sh - packs a CUDA build for a GPU machine that cannot build the
# project (no ZeroMQ, libsodium or cmocka headers there), to be run there
# with gpu-check.sh's NO_BUILD=1.
#
#   kernels/cuda/gpu-pack.sh BUILD DEST
#
# BUILD: a build with -DFEDINFER_CUDA=ON (the GPU machine needs the same
# CUDA major version: the binaries link libcublasLt.so.N and libnccl.so.2,
# which must be found there). DEST receives bin/ (fedinfer, libfi_cuda.so,
# fi_cuda_probe, tests/test_cuda, tests/test_nccl, tests/group_gpu_check)
# and lib/ (every library those need except glibc's, the C++ runtime's and
# cuBLASLt's and NCCL's, which are large and come with CUDA there). There:
#
#   LD_LIBRARY_PATH=DEST/lib:DEST/bin:<the CUDA libraries' folders> \
#   NO_BUILD=1 BUILD=DEST/bin FEDINFER_MODEL=... kernels/cuda/gpu-check.sh
set -eu
[ $# -eq 2 ] || { echo "usage: gpu-pack.sh BUILD DEST" >&2; exit 2; }
build=$1 dest=$2
mkdir -p "$dest/bin/tests" "$dest/lib"
for f in fedinfer libfi_cuda.so fi_cuda_probe; do
    [ -f "$build/$f" ] || { echo "gpu-pack: $build/$f is missing (a CUDA build?)" >&2; exit 1; }
    cp "$build/$f" "$dest/bin/"
done
for f in test_cuda test_nccl group_gpu_check; do
    [ -f "$build/tests/$f" ] || { echo "gpu-pack: $build/tests/$f is missing" >&2; exit 1; }
    cp "$build/tests/$f" "$dest/bin/tests/"
done
for f in "$dest"/bin/* "$dest"/bin/tests/*; do
    [ -f "$f" ] && ldd "$f" 2>/dev/null
done | awk '/=>/ {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libpthread|libdl|librt|libresolv|libgcc_s|libstdc\+\+)\.so|libcublas|libnccl|libfi_cuda' |
    while read -r lib; do cp -L "$lib" "$dest/lib/"; done
echo "gpu-pack: $(du -sh "$dest" | cut -f1) in $dest"
