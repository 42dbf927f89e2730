// Closes an ISA clone opened by cpu_isa_begin.h.
#if defined(__x86_64__)
#pragma GCC pop_options
#endif
