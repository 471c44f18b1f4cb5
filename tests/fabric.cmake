# fabric.cmake - the fabric's extra test set-up (included by
# tests/CMakeLists.txt after every tests/test_*.c is registered).
#
#  - fi_fabric_peer: test-only program running the coordinator, an echo
#    worker or the fedctl verbs as separate processes (kill -9 tests, CLI).
#  - labels: the fabric's unit tests run in the sanitizer build (asan).
#  - fuzz_wire: libFuzzer target for the wire decoder, clang only, run for
#    a bounded time as a test; skipped with a message elsewhere.
if(NOT TARGET fi_fabric)
  return()
endif()

add_executable(fi_fabric_peer ${CMAKE_CURRENT_LIST_DIR}/fabric/fi_fabric_peer.c)
target_link_libraries(fi_fabric_peer PRIVATE fi_fabric)
set_target_properties(fi_fabric_peer PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})

file(GLOB FI_FABRIC_TESTS CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/test_fabric*.c)
foreach(src ${FI_FABRIC_TESTS})
  get_filename_component(name ${src} NAME_WE)
  add_dependencies(${name} fi_fabric_peer)
  target_compile_definitions(${name} PRIVATE
    FI_FABRIC_PEER="$<TARGET_FILE:fi_fabric_peer>")
  set_tests_properties(${name} PROPERTIES LABELS asan TIMEOUT 120)
endforeach()

# The command-line walk-through (keygen, --init, fedctl verbs, a worker):
add_test(NAME fabric_cli COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/fabric/cli.sh
         $<TARGET_FILE:fi_fabric_peer>)
set_tests_properties(fabric_cli PROPERTIES TIMEOUT 60)

# Fuzzing the decoder: libFuzzer needs clang.
set(FI_FUZZ_CORPUS ${CMAKE_CURRENT_BINARY_DIR}/fuzz_wire_corpus)
add_executable(fuzz_wire_seeds ${CMAKE_CURRENT_LIST_DIR}/fuzz/fuzz_wire_seeds.c)
target_link_libraries(fuzz_wire_seeds PRIVATE fi_fabric)
if(FI_FUZZERS)
  # The decoder and the generated descriptors are compiled into the target
  # itself so that libFuzzer's coverage sees them.
  set(FI_FUZZ_GEN ${CMAKE_BINARY_DIR}/fabric/gen/fi_fabric.pb-c.c)
  set_source_files_properties(${FI_FUZZ_GEN} PROPERTIES GENERATED TRUE)
  add_executable(fuzz_wire ${CMAKE_CURRENT_LIST_DIR}/fuzz/fuzz_wire.c
                 ${CMAKE_SOURCE_DIR}/fabric/fi_wire.c ${FI_FUZZ_GEN})
  add_dependencies(fuzz_wire fi_fabric)
  target_include_directories(fuzz_wire PRIVATE ${CMAKE_SOURCE_DIR}/fabric ${CMAKE_BINARY_DIR}/fabric/gen)
  target_compile_options(fuzz_wire PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(fuzz_wire PRIVATE -fsanitize=fuzzer,address,undefined)
  pkg_check_modules(FI_FUZZ_PROTOBUFC REQUIRED IMPORTED_TARGET libprotobuf-c)
  pkg_check_modules(FI_FUZZ_SODIUM REQUIRED IMPORTED_TARGET libsodium) # fi_wire_free wipes tokens
  target_link_libraries(fuzz_wire PRIVATE PkgConfig::FI_FUZZ_PROTOBUFC PkgConfig::FI_FUZZ_SODIUM)
  add_test(NAME fuzz_wire
           COMMAND bash -c "rm -rf '${FI_FUZZ_CORPUS}' && mkdir -p '${FI_FUZZ_CORPUS}' && \
'$<TARGET_FILE:fuzz_wire_seeds>' '${FI_FUZZ_CORPUS}' && \
'$<TARGET_FILE:fuzz_wire>' -max_total_time=20 -max_len=4096 -rss_limit_mb=1024 \
'${FI_FUZZ_CORPUS}'")
  set_tests_properties(fuzz_wire PROPERTIES TIMEOUT 120 LABELS asan)
else()
  add_test(NAME fuzz_wire COMMAND ${CMAKE_COMMAND} -E echo
           "fuzz_wire skipped: libFuzzer needs clang, and no ThreadSanitizer build (configure with -DCMAKE_C_COMPILER=clang)")
  set_tests_properties(fuzz_wire PROPERTIES SKIP_REGULAR_EXPRESSION "skipped")
endif()

# The process tests time heartbeats in 100 ms steps: run them alone, so the
# other tests of a parallel ctest do not starve the processes they watch.
if(TEST test_fabric_procs)
  set_tests_properties(test_fabric_procs PROPERTIES RUN_SERIAL TRUE)
endif()
