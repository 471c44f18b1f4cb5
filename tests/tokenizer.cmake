# Tokenizer tests.
#
# test_tokenizer (registered by the glob in CMakeLists.txt) parses outside
# input (GGUF metadata, arbitrary bytes): it also runs in the sanitizer
# build (label asan).
#
# fuzz_tokenizer: a libFuzzer target over text (SmolLM2's tokenizer) and
# tokenizer metadata (any GGUF). libFuzzer comes with clang only, so the
# target and its test exist only when the C compiler is clang. The
# tokenizer and the GGUF reader are compiled into the target itself, with
# the fuzzer's coverage instrumentation. fuzz_tokenizer_seeds writes a seed
# corpus into the build folder first (a fixture).
#
# test_tokenizer wraps malloc, calloc and realloc (-Wl,--wrap) to fail the
# Nth allocation of the code it links statically (the tokenizer).
if(TARGET test_tokenizer)
  set_tests_properties(test_tokenizer PROPERTIES LABELS asan)
  target_link_options(test_tokenizer PRIVATE -Wl,--wrap=malloc -Wl,--wrap=calloc
                                             -Wl,--wrap=realloc)
endif()

if(FI_FUZZERS AND TARGET fi_test_support)
  add_executable(fuzz_tokenizer ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_tokenizer.c
                                ${PROJECT_SOURCE_DIR}/core/tokenizer.c
                                ${PROJECT_SOURCE_DIR}/core/tokenizer_chat.c
                                ${PROJECT_SOURCE_DIR}/core/gguf.c)
  target_include_directories(fuzz_tokenizer PRIVATE ${PROJECT_SOURCE_DIR}/core
                                                    ${PROJECT_SOURCE_DIR}/kernels)
  target_compile_definitions(fuzz_tokenizer PRIVATE FI_TEST_MODEL="${FEDINFER_DEFAULT_MODEL}")
  target_compile_options(fuzz_tokenizer PRIVATE -fsanitize=fuzzer,address -fno-omit-frame-pointer)
  target_link_options(fuzz_tokenizer PRIVATE -fsanitize=fuzzer,address)
  # core's imported utf8proc target is local to core/: import it here too
  pkg_check_modules(FI_TOK_UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
  pkg_check_modules(FI_TOK_SODIUM REQUIRED IMPORTED_TARGET libsodium) # gguf.c's fi_gguf_sha256
  target_link_libraries(fuzz_tokenizer PRIVATE PkgConfig::FI_TOK_UTF8PROC PkgConfig::FI_TOK_SODIUM)

  add_executable(fuzz_tokenizer_seeds ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_tokenizer_seeds.c)
  target_link_libraries(fuzz_tokenizer_seeds PRIVATE fi_test_support)
  target_compile_definitions(fuzz_tokenizer_seeds PRIVATE FI_TEST_DIR="${CMAKE_CURRENT_SOURCE_DIR}")

  set(FI_FUZZ_TOK_CORPUS ${CMAKE_CURRENT_BINARY_DIR}/fuzz_tokenizer_corpus)
  add_test(NAME fuzz_tokenizer_seeds COMMAND fuzz_tokenizer_seeds ${FI_FUZZ_TOK_CORPUS})
  set_tests_properties(fuzz_tokenizer_seeds PROPERTIES FIXTURES_SETUP fuzz_tokenizer_corpus
                                                       LABELS asan)
  add_test(NAME fuzz_tokenizer
           COMMAND fuzz_tokenizer -max_total_time=20 -timeout=10 -rss_limit_mb=2048
                   -print_final_stats=1
                   -artifact_prefix=${CMAKE_CURRENT_BINARY_DIR}/fuzz_tokenizer_crash_
                   ${FI_FUZZ_TOK_CORPUS})
  set_tests_properties(fuzz_tokenizer PROPERTIES FIXTURES_REQUIRED fuzz_tokenizer_corpus
                                                 LABELS "asan;fuzz" TIMEOUT 120)
endif()
