// The extension module megakernels._C: importing it loads this library, which runs every family's
// TORCH_LIBRARY_FRAGMENT registration (csrc/bindings/*.cpp) under the `megakernels` namespace defined here.
#include <Python.h>

#include "common.h"

TORCH_LIBRARY(megakernels, m) {
  m.def("build_flags() -> int", &megakernels::bindings::build_flags);
  m.def("cpu_isa() -> str", &megakernels::bindings::cpu_isa_name);
  m.def("cpu_isa_refusal(str best, str want) -> str", &megakernels::bindings::cpu_isa_refusal);
}

// A plain extension module: importing megakernels._C loads the library and runs the registrations above.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "megakernels compiled ops (torch.ops.megakernels)",
                                      -1, nullptr};
  return PyModule_Create(&module);
}
