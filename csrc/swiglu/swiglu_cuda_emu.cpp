// The CUDA kernels of swiglu_cuda.cu, compiled by the host compiler against the CUDA emulator (csrc/emu) so that
// they run on CPU tensors under MEGAKERNELS_BACKEND=cuda_emu. Same source, namespace megakernels::cuda_emu.
#define MEGAKERNELS_CUDA_EMU 1
#include "swiglu_cuda.cu"
