// The AVX2 clone of permute_cpu.cpp, chosen at run time on a CPU that has it (csrc/common/cpu_isa.h).
#define MK_CPU_ISA avx2
#define MK_CPU_ISA_LEVEL 1
#include "../common/cpu_isa_begin.h"
#include "permute_cpu.cpp"
#include "../common/cpu_isa_end.h"
