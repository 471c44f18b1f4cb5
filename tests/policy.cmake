# Policy engine tests (issue 4): sanitizer labels, the allocation-counting
# link for test_policy_noalloc, the example cases run through fedctl, the
# console test, and a bounded libFuzzer run of the parser (clang only).

set(FI_POLICY_CMOCKA test_policy_parse test_policy_check test_policy_eval test_policy_bundle
    test_policy_audit test_policy_noalloc test_policy_cli)
foreach(t ${FI_POLICY_CMOCKA})
  if(TARGET ${t})
    set_tests_properties(${t} PROPERTIES LABELS asan)
  endif()
endforeach()

# Every allocation of the policy library goes through the test's counters.
if(TARGET test_policy_noalloc)
  target_link_options(test_policy_noalloc PRIVATE
    -Wl,--wrap=malloc -Wl,--wrap=calloc -Wl,--wrap=realloc)
endif()

if(TARGET fedctl)
  foreach(ex eu-hospital us-bank sovereign)
    add_test(NAME policy_cases_${ex}
      COMMAND $<TARGET_FILE:fedctl> policy test
              ${CMAKE_SOURCE_DIR}/examples/policies/${ex}.policy
              ${CMAKE_SOURCE_DIR}/examples/policies/${ex}.cases)
    set_tests_properties(policy_cases_${ex} PROPERTIES LABELS asan TIMEOUT 60)
  endforeach()
  # The console end to end: the test finds fedctl through FEDCTL.
  if(TARGET test_policy_cli)
    set_tests_properties(test_policy_cli PROPERTIES
      ENVIRONMENT "CMOCKA_MESSAGE_OUTPUT=stdout;FEDCTL=$<TARGET_FILE:fedctl>")
  endif()
endif()

if(FI_FUZZERS)
  # The library's sources are compiled into the target so that libFuzzer
  # sees their coverage.
  file(GLOB FI_POLICY_FUZZ_SRC CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/policy/*.c)
  add_executable(fuzz_policy ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_policy.c ${FI_POLICY_FUZZ_SRC})
  target_include_directories(fuzz_policy PRIVATE ${CMAKE_SOURCE_DIR}/policy)
  target_compile_options(fuzz_policy PRIVATE -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -g)
  target_link_options(fuzz_policy PRIVATE -fsanitize=fuzzer,address,undefined)
  pkg_check_modules(FI_FUZZ_SODIUM REQUIRED IMPORTED_TARGET libsodium)
  pkg_check_modules(FI_FUZZ_SQLITE3 REQUIRED IMPORTED_TARGET sqlite3)
  target_link_libraries(fuzz_policy PRIVATE PkgConfig::FI_FUZZ_SODIUM PkgConfig::FI_FUZZ_SQLITE3 m)
  # New inputs go to the build's corpus; the sources' files are seeds.
  set(FI_POLICY_FUZZ_CORPUS ${CMAKE_CURRENT_BINARY_DIR}/fuzz_policy_corpus)
  file(MAKE_DIRECTORY ${FI_POLICY_FUZZ_CORPUS})
  add_test(NAME fuzz_policy
    COMMAND fuzz_policy -max_total_time=15 -max_len=4096 -rss_limit_mb=2048
            ${FI_POLICY_FUZZ_CORPUS} ${CMAKE_CURRENT_SOURCE_DIR}/policy/bad
            ${CMAKE_SOURCE_DIR}/examples/policies)
  set_tests_properties(fuzz_policy PROPERTIES LABELS "asan;fuzz" TIMEOUT 120)
endif()

# What witnessing the audit log costs (a benchmark, not a test):
#   ./build/tests/bench_audit [RECORDS [WITNESSES]]
# The ctest run is a smoke run on a small log: every figure is printed.
if(TARGET fi_test_support)
  add_executable(bench_audit ${CMAKE_CURRENT_LIST_DIR}/policy/bench_audit.c)
  target_link_libraries(bench_audit PRIVATE ${FI_TEST_LIBS})
  add_test(NAME bench_audit_smoke COMMAND sh -c
    "out=$($<TARGET_FILE:bench_audit> 2000 10) || exit 1; echo \"$out\"; for k in 'log:' 'fi_audit_head' 'fi_audit_witness_check' 'fi_audit_witness_put of 10' 'with 10 ('; do echo \"$out\" | grep -qF \"$k\" || { echo \"missing: $k\"; exit 1; }; done")
  set_tests_properties(bench_audit_smoke PROPERTIES TIMEOUT 120)
endif()
