# kernels: the unit test runs under the sanitizers too (tests/run.sh runs
# every test labelled asan in the clang ASan/UBSan build).
set_tests_properties(test_kernels PROPERTIES LABELS asan)
