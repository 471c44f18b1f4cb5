# kernels: the unit tests run under the sanitizers too (tests/run.sh runs
# every test labelled asan in the clang ASan/UBSan build).
set_tests_properties(test_kernels test_attention_paged PROPERTIES LABELS asan)

# Micro-benchmark of the CPU kernels and the pool (a program, not a test):
#   ./build/tests/bench_kernels [threads...]
add_executable(bench_kernels ${CMAKE_CURRENT_LIST_DIR}/bench_kernels.c)
target_link_libraries(bench_kernels PRIVATE fi_kernels)

# How the AMX tile unit and vector FMAs share a core (a program, not a
# test; built where the compiler knows AMX, and it checks the processor):
#   ./build/tests/bench_amx
if(FI_CC_HAS_AMX)
  add_executable(bench_amx ${CMAKE_CURRENT_LIST_DIR}/bench_amx.c)
endif()
