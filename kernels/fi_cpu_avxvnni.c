/*
 * fi_cpu_avxvnni.c - the x86 kernels (fi_cpu_x86_impl.h) with AVX-VNNI's
 * vpdpbusd for the int8 dot products. Compiled with -mavx2 -mfma -mf16c
 * -mavxvnni (when the compiler knows it) and entered only after fi_cpu.c
 * has checked the processor.
 */
#define FI_X86_VNNI 1
#include "fi_cpu_x86_impl.h"

void fi_cpu_kernels_avxvnni(fi_cpu_kernels *k) {
    s_x86_fill(k, "avxvnni");
}
