/*
 * fi_cpu_avx2.c - the x86 kernels (fi_cpu_x86_impl.h) for AVX2 + FMA +
 * F16C. Compiled with -mavx2 -mfma -mf16c and entered only after
 * fi_cpu.c has checked the processor.
 */
#define FI_X86_VNNI 0
#include "fi_cpu_x86_impl.h"

void fi_cpu_kernels_avx2(fi_cpu_kernels *k) {
    s_x86_fill(k, "avx2");
}
