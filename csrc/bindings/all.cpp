// The whole torch-facing layer as one translation unit (what setup.py compiles). Every bindings file parses the
// same torch headers (torch/library.h and ATen's Tensor: ~7 s of g++ each); compiled together they are parsed
// once. Each family keeps its own file and its own namespace (<family>_ops), and each file still compiles on
// its own (editors, clangd); the TORCH_LIBRARY_* blocks get unique names, so several may share a unit.
#include "common.cpp"
#include "module.cpp"
#include "bias_gelu.cpp"
#include "cross_entropy.cpp"
#include "flash_attention.cpp"
#include "moe.cpp"
#include "muon.cpp"
#include "norms.cpp"
#include "optim.cpp"
#include "rope.cpp"
#include "softmax.cpp"
#include "swiglu.cpp"
