# GGUF reader tests: test_gguf (registered by the glob in CMakeLists.txt)
# runs under the sanitizers too; fuzz_gguf is a libFuzzer target, built and
# run only with clang.
set_tests_properties(test_gguf PROPERTIES LABELS asan)
