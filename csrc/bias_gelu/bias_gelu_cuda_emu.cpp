// The CUDA kernels of bias_gelu_cuda.cu, compiled by the host compiler against the CUDA emulator (csrc/emu) so they
// run on CPU tensors under MEGAKERNELS_BACKEND=cuda_emu. Same source, namespace megakernels::cuda_emu.
#define MEGAKERNELS_CUDA_EMU 1
#include "bias_gelu_cuda.cu"
