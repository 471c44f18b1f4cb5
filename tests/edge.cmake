# Edge agent tests (issue 5): the C tests run under the sanitizers too
# (label asan); the Python client tests and end-to-end scripts need the
# venv that examples/setup.sh creates.
# test_edge_coord and test_edge_fabric need no model. test_edge runs the
# real model behind the HTTP server: under the sanitizers (tests/run.sh
# builds them at -O1, several times slower), ThreadSanitizer's too, it is
# built with FI_EDGE_TEST_QUICK (fewer clients and tokens, time limits of
# 240 s): about 75 s on 2 cores of earlier machines, 134 s under
# AddressSanitizer and 208 s under ThreadSanitizer on the Zen 3 one
# (176-183 s under AddressSanitizer there on a slower day, 110 s with the
# quick build's shorter closed loop in test_no_429_within_capacity).
foreach(t test_edge test_edge_coord test_edge_fabric test_edge_route)
  if(TARGET ${t})
    set_tests_properties(${t} PROPERTIES LABELS asan TIMEOUT 300)
  endif()
endforeach()

# Python tests: the official openai client from PyPI, in the venv that
# examples/setup.sh makes at .venv (tests/run.sh runs setup first).
set(FI_EDGE_VENV_PY ${CMAKE_SOURCE_DIR}/.venv/bin/python)
set(FI_EDGE_PY_ENV "FEDINFER_BUILD=${CMAKE_BINARY_DIR};FEDINFER_MODEL=${FEDINFER_DEFAULT_MODEL}")
if(TARGET fedinfer)
  add_test(NAME edge_openai
    COMMAND sh -c "if [ ! -x '${FI_EDGE_VENV_PY}' ]; then echo 'edge_openai: no venv at ${CMAKE_SOURCE_DIR}/.venv: run examples/setup.sh first' >&2; exit 1; fi; exec '${FI_EDGE_VENV_PY}' '${CMAKE_CURRENT_SOURCE_DIR}/edge/test_openai.py'"
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(edge_openai PROPERTIES TIMEOUT 180 ENVIRONMENT "${FI_EDGE_PY_ENV}")
endif()
if(TARGET fedinfer AND TARGET fedctl)
  add_test(NAME edge_e2e
    COMMAND sh -c "if [ ! -x '${FI_EDGE_VENV_PY}' ]; then echo 'edge_e2e: no venv at ${CMAKE_SOURCE_DIR}/.venv: run examples/setup.sh first' >&2; exit 1; fi; exec '${FI_EDGE_VENV_PY}' '${CMAKE_CURRENT_SOURCE_DIR}/edge/test_e2e.py'"
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(edge_e2e PROPERTIES TIMEOUT 240 ENVIRONMENT "${FI_EDGE_PY_ENV}")
endif()
if(TARGET test_edge AND (FEDINFER_SANITIZE OR FEDINFER_TSAN))
  target_compile_definitions(test_edge PRIVATE FI_EDGE_TEST_QUICK=1)
endif()

# The edge's overhead benchmark (not a test): build/tests/bench_edge.
add_executable(bench_edge ${CMAKE_CURRENT_SOURCE_DIR}/edge/bench_edge.c)
target_link_libraries(bench_edge PRIVATE ${FI_TEST_LIBS})
target_compile_definitions(bench_edge PRIVATE FI_TEST_MODEL="${FEDINFER_DEFAULT_MODEL}")

# Fuzzing the edge's Content-Length check (edge/edge_head.c), the one parser
# of outside input the edge has before libmicrohttpd: libFuzzer needs clang.
if(TARGET fi_edge AND FI_FUZZERS)
  add_executable(fuzz_http_head ${CMAKE_CURRENT_LIST_DIR}/edge/fuzz_http_head.c
                 ${CMAKE_SOURCE_DIR}/edge/edge_head.c)
  target_link_libraries(fuzz_http_head PRIVATE fi_edge)
  target_compile_options(fuzz_http_head PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(fuzz_http_head PRIVATE -fsanitize=fuzzer,address,undefined)
  add_test(NAME fuzz_http_head
           COMMAND $<TARGET_FILE:fuzz_http_head> -max_total_time=10 -max_len=2048 -rss_limit_mb=1024)
  set_tests_properties(fuzz_http_head PROPERTIES TIMEOUT 60 LABELS asan)
elseif(TARGET fi_edge)
  add_test(NAME fuzz_http_head COMMAND ${CMAKE_COMMAND} -E echo
           "fuzz_http_head skipped: libFuzzer needs clang, and no ThreadSanitizer build (configure with -DCMAKE_C_COMPILER=clang)")
  set_tests_properties(fuzz_http_head PROPERTIES SKIP_REGULAR_EXPRESSION "skipped")
endif()
