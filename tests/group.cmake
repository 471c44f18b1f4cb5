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
