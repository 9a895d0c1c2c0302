# Sourced, not run: the CUDA toolchain for building (or checking) the `cuda` feature on a machine
# without a GPU (the recipe of ../shared/gpu.md): nvcc and the CUDA 13.0 libraries from NVIDIA's
# PyPI wheels in a venv, a link-only stub of libcuda, compute capability 9.0 (H100 / H200).
# Used by scripts/build-cuda.sh and by .ci/run's `cargo check --features cuda`.
#
#   source scripts/cuda-env.sh && cargo check --release --features cuda
VENV=${CUDA_VENV:-/tmp/cudavenv}
if [ ! -x "$VENV/bin/pip" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88 \
  nvidia-curand==10.4.0.35 nvidia-cublas==13.0.2.14
CU=$("$VENV/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
# the wheels ship versioned .so files only; the linker wants the plain names
(cd "$CU/lib" && for l in cudart cublas cublasLt nvrtc; do ln -sf "lib$l.so.13" "lib$l.so"; done && ln -sf libcurand.so.10 libcurand.so)
# no driver here: a link-only stub with every cu* symbol cudarc declares
cargo fetch -q
mkdir -p "$CU/lib/stubs"
grep -ohE 'pub unsafe fn cu[A-Za-z0-9_]+\(' ~/.cargo/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs \
  | sed 's/pub unsafe fn //; s/($//' | sort -u | awk '{print "void " $1 "(void) {}"}' > /tmp/libcuda_stub.c
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CU/lib/stubs/libcuda.so" /tmp/libcuda_stub.c
export PATH=$CU/bin:$PATH CUDA_HOME=$CU CUDA_PATH=$CU CUDA_ROOT=$CU NVCC=$CU/bin/nvcc
export CUDA_COMPUTE_CAP=90 CUDARC_CUDA_VERSION=13000
export LIBRARY_PATH=$CU/lib:$CU/lib/stubs:${LIBRARY_PATH:-}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
