# Edge agent tests (issue 5): the C tests run under the sanitizers too
# (label asan); the Python client tests and end-to-end scripts need the
# venv that examples/setup.sh creates.
foreach(t test_edge)
  if(TARGET ${t})
    set_tests_properties(${t} PROPERTIES LABELS asan TIMEOUT 300)
  endif()
endforeach()
