# Sourced by scripts/setup.sh and scripts/test.sh: a compiler cache (ccache) shared by every checkout on this
# machine, so a fresh clone compiles only what no checkout has compiled before (the extension's CPU kernels and
# their ISA clones, the CUDA kernels, the C++ tests). Both builds run inside the checkout (build/temp, build/cmake)
# and ccache rewrites the checkout's paths relative to it (CCACHE_BASEDIR), so clones at different paths share
# objects. torch's extension build puts ccache in front of c++ and nvcc by itself when it is on PATH; CMake is
# told through MEGAKERNELS_CMAKE_LAUNCHER. Installed with apt-get when missing and this is root on a machine that
# has apt; otherwise, or with MEGAKERNELS_NO_CCACHE=1, everything compiles without a cache.
MEGAKERNELS_CMAKE_LAUNCHER=""
if [ "${MEGAKERNELS_NO_CCACHE:-0}" = 1 ]; then
  export TORCH_NO_COMPILER_WRAPPER=1
else
  if ! command -v ccache >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq ccache >/dev/null 2>&1 \
      || echo "megakernels: apt-get could not install ccache; compiling without a compiler cache" >&2
  fi
  if command -v ccache >/dev/null 2>&1; then
    export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}
    MEGAKERNELS_CMAKE_LAUNCHER="-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"
  fi
fi
