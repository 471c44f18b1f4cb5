# group.cmake - shard groups' extra test set-up (included by
# tests/CMakeLists.txt after every tests/test_*.c is registered).
#
#  - test_group_conf, test_group_net: unit tests of the group's files,
#    plans, mesh and collectives; they run in the sanitizer build (asan).
#  - test_group_model: the default model over TP=2, TP=3, PP=2, TP=2xPP=2
#    groups in threads against the single-process engine (a few tens of
#    seconds on two cores).
#  - the process tests (test_group_procs) start ranks as processes and time
#    failures in heartbeats: they run alone (RUN_SERIAL), so a parallel
#    ctest does not starve the processes they watch.
if(NOT TARGET fi_fabric)
  return()
endif()

foreach(name test_group_conf test_group_net)
  if(TEST ${name})
    set_tests_properties(${name} PROPERTIES LABELS asan TIMEOUT 120)
  endif()
endforeach()

if(TEST test_group_model)
  set_tests_properties(test_group_model PROPERTIES TIMEOUT 600 RUN_SERIAL TRUE)
endif()

if(TEST test_group_procs)
  if(TARGET fedinfer)
    add_dependencies(test_group_procs fedinfer)
  endif()
  set_tests_properties(test_group_procs PROPERTIES TIMEOUT 600 RUN_SERIAL TRUE)
endif()

# On GPUs (CUDA builds): a TP=2 group with its slices on the GPUs (NCCL
# sums with two GPUs or more, CURVE sums of device vectors with one)
# against the CPU engine. Exits 77 (skipped) without a GPU.
if(FEDINFER_HAVE_CUDA)
  add_executable(group_gpu_check ${CMAKE_CURRENT_LIST_DIR}/group_gpu_check.c)
  target_link_libraries(group_gpu_check PRIVATE ${FI_TEST_LIBS})
  target_compile_definitions(group_gpu_check PRIVATE FI_TEST_MODEL="${FEDINFER_DEFAULT_MODEL}")
  add_dependencies(group_gpu_check fi_cuda)
  add_test(NAME group_gpu_check COMMAND group_gpu_check)
  set_tests_properties(group_gpu_check PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300 RUN_SERIAL TRUE)
endif()

# The group benchmark runs (every layout forms and serves), names the
# micro-batched layout by -u, and reports no negative time: its per-token
# figures come from counters read around the decode itself.
if(TARGET fi_group_bench)
  add_test(NAME group_bench COMMAND sh -c
    "out=$('$<TARGET_FILE:fi_group_bench>' -m '${FEDINFER_DEFAULT_MODEL}' -t 1 -b 8 -n 4 -p 8 -u 2) || exit 1
     echo \"$out\"
     echo \"$out\" | awk '/^(TP|PP)/ { rows++; for (i = 3; i <= NF; i++) if ($i + 0 < 0) bad++ }
                         /^PP=2,mb=2 / { mb++ } /^PP=2,mb=0 / { whole++ }
                         END { exit !(rows == 5 && !bad && mb == 1 && whole == 1) }'")
  set_tests_properties(group_bench PROPERTIES LABELS "model" TIMEOUT 300 RUN_SERIAL TRUE
                       REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL}")
endif()
