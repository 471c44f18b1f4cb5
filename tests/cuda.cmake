# cuda.cmake - the CUDA backend's tests, only in a build with CUDA
# (FEDINFER_HAVE_CUDA). Their sources live in tests/cuda/ so that the
# test_*.c glob of tests/CMakeLists.txt does not pick them up in builds
# without CUDA. Without a device each prints "SKIPPED: ..." and exits 77,
# which ctest reports as skipped, not passed or failed.
#   test_cuda  every operation against the CPU backend, and the model end to
#              end (needs one device)
#   test_nccl  the NCCL all-reduce wrapper (needs two devices)
if(FEDINFER_HAVE_CUDA)
  foreach(name test_cuda test_nccl)
    add_executable(${name} ${CMAKE_CURRENT_LIST_DIR}/cuda/${name}.c)
    target_link_libraries(${name} PRIVATE ${FI_TEST_LIBS} PkgConfig::CMOCKA)
    target_compile_definitions(${name} PRIVATE FI_TEST_MODEL="${FEDINFER_DEFAULT_MODEL}")
    add_test(NAME ${name} COMMAND ${name})
    set_tests_properties(${name} PROPERTIES
      SKIP_RETURN_CODE 77
      TIMEOUT 300
      LABELS cuda
      ENVIRONMENT "CMOCKA_MESSAGE_OUTPUT=stdout")
  endforeach()
endif()
