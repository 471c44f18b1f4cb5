# cuda.cmake - the CUDA backend's tests, only in a build with CUDA
# (FEDINFER_HAVE_CUDA). Their sources live in tests/cuda/ so that the
# test_*.c glob of tests/CMakeLists.txt does not pick them up in builds
# without CUDA. Without a device each prints "SKIPPED: ..." and exits 77,
# which ctest reports as skipped, not passed or failed.
#   test_cuda  every operation against the CPU backend, and the model end to
#              end (needs one device)
#   test_nccl  the NCCL all-reduce wrapper (needs two devices)
#   test_cuda_loader  a process that links the module uses its own copy
#              (needs no device: a stand-in libcuda.so.1 passes the
#              loader's driver check)
# and builds fi_cuda_probe (see below).
if(FEDINFER_HAVE_CUDA)
  foreach(name test_cuda test_nccl)
    add_executable(${name} ${CMAKE_CURRENT_LIST_DIR}/cuda/${name}.c)
    target_link_libraries(${name} PRIVATE fi_cuda ${FI_TEST_LIBS} PkgConfig::CMOCKA)
    target_compile_definitions(${name} PRIVATE FI_TEST_MODEL="${FEDINFER_DEFAULT_MODEL}")
    add_test(NAME ${name} COMMAND ${name})
    set_tests_properties(${name} PROPERTIES
      SKIP_RETURN_CODE 77
      TIMEOUT 300
      LABELS cuda
      ENVIRONMENT "CMOCKA_MESSAGE_OUTPUT=stdout")
  endforeach()
  # A libcuda.so.1 with no symbols, for test_cuda_loader only: the loader
  # checks that the driver can be opened before it looks for the module.
  add_library(fi_stand_in_driver SHARED ${CMAKE_CURRENT_LIST_DIR}/cuda/stand_in_driver.c)
  set_target_properties(fi_stand_in_driver PROPERTIES OUTPUT_NAME cuda SUFFIX ".so.1"
    LIBRARY_OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}/stand_in_driver)
  add_executable(test_cuda_loader ${CMAKE_CURRENT_LIST_DIR}/cuda/test_cuda_loader.c)
  target_link_libraries(test_cuda_loader PRIVATE fi_cuda ${FI_TEST_LIBS} PkgConfig::CMOCKA)
  add_dependencies(test_cuda_loader fi_stand_in_driver)
  add_test(NAME test_cuda_loader COMMAND test_cuda_loader)
  set_tests_properties(test_cuda_loader PROPERTIES
    TIMEOUT 60
    LABELS cuda
    ENVIRONMENT "CMOCKA_MESSAGE_OUTPUT=stdout;LD_LIBRARY_PATH=${CMAKE_CURRENT_BINARY_DIR}/stand_in_driver;FEDINFER_CUDA_MODULE=/nonexistent/libfi_cuda.so")

  # gpu-pack.sh on this build: the binaries and their libraries (ZeroMQ
  # among them), as a GPU machine without the build dependencies gets them.
  add_test(NAME gpu_pack COMMAND sh -c
    "rm -rf '${CMAKE_CURRENT_BINARY_DIR}/gpu-pack' && '${CMAKE_SOURCE_DIR}/kernels/cuda/gpu-pack.sh' '${CMAKE_BINARY_DIR}' '${CMAKE_CURRENT_BINARY_DIR}/gpu-pack' && test -x '${CMAKE_CURRENT_BINARY_DIR}/gpu-pack/bin/tests/test_cuda' && test -f '${CMAKE_CURRENT_BINARY_DIR}/gpu-pack/bin/libfi_cuda.so' && ls '${CMAKE_CURRENT_BINARY_DIR}/gpu-pack/lib' | grep -q '^libzmq'")
  set_tests_properties(gpu_pack PROPERTIES TIMEOUT 60 LABELS cuda)

  # Throughput probe for kernels/cuda/gpu-check.sh (not a test): cuBLASLt
  # GEMMs at the model's shapes against a large square GEMM, prefill and
  # decode timings with CUDA-event kernel sums. Here because --synthetic
  # writes its model with tests/support.
  add_executable(fi_cuda_probe ${CMAKE_SOURCE_DIR}/kernels/cuda/fi_cuda_probe.c)
  target_link_libraries(fi_cuda_probe PRIVATE fi_cuda ${FI_TEST_LIBS})
  set_target_properties(fi_cuda_probe PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
endif()
