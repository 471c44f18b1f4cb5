# GGUF reader tests.
#
# test_gguf (registered by the glob in CMakeLists.txt) also runs in the
# sanitizer build (label asan).
#
# fuzz_gguf: a libFuzzer target over fi_gguf_open_memory. libFuzzer comes
# with clang only, so the target and its test exist only when the C
# compiler is clang. core/gguf.c is compiled into the target itself, with
# the fuzzer's coverage instrumentation. The test first writes a seed
# corpus (fuzz_gguf_seeds, a fixture) into the build folder, then fuzzes
# for a bounded time; the corpus grows in the build folder between runs.
set_tests_properties(test_gguf PROPERTIES LABELS asan)
# Allocation-failure injection: test_gguf wraps malloc and friends (GNU ld).
if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
  target_link_options(test_gguf PRIVATE
    "LINKER:--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=free")
  target_compile_definitions(test_gguf PRIVATE FI_TEST_WRAP_ALLOC=1)
endif()

if(FI_FUZZERS)
  add_executable(fuzz_gguf ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_gguf.c
                           ${PROJECT_SOURCE_DIR}/core/gguf.c)
  target_include_directories(fuzz_gguf PRIVATE ${PROJECT_SOURCE_DIR}/core
                                               ${PROJECT_SOURCE_DIR}/kernels)
  target_compile_options(fuzz_gguf PRIVATE -fsanitize=fuzzer,address -fno-omit-frame-pointer)
  target_link_options(fuzz_gguf PRIVATE -fsanitize=fuzzer,address)
  pkg_check_modules(FI_GGUF_SODIUM REQUIRED IMPORTED_TARGET libsodium) # fi_gguf_sha256
  target_link_libraries(fuzz_gguf PRIVATE PkgConfig::FI_GGUF_SODIUM)

  add_executable(fuzz_gguf_seeds ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_gguf_seeds.c)
  target_link_libraries(fuzz_gguf_seeds PRIVATE fi_test_support)

  set(FI_FUZZ_GGUF_CORPUS ${CMAKE_CURRENT_BINARY_DIR}/fuzz_gguf_corpus)
  add_test(NAME fuzz_gguf_seeds COMMAND fuzz_gguf_seeds ${FI_FUZZ_GGUF_CORPUS})
  set_tests_properties(fuzz_gguf_seeds PROPERTIES FIXTURES_SETUP fuzz_gguf_corpus LABELS asan)
  add_test(NAME fuzz_gguf
           COMMAND fuzz_gguf -max_total_time=20 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
                   -artifact_prefix=${CMAKE_CURRENT_BINARY_DIR}/fuzz_gguf_crash_
                   ${FI_FUZZ_GGUF_CORPUS})
  set_tests_properties(fuzz_gguf PROPERTIES FIXTURES_REQUIRED fuzz_gguf_corpus
                                            LABELS "asan;fuzz" TIMEOUT 120)
else()
  message(STATUS "fedinfer: fuzz_gguf not built: libFuzzer needs clang and no ThreadSanitizer "
                 "(C compiler is ${CMAKE_C_COMPILER_ID})")
endif()
