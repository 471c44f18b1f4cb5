# pshipping.cmake - policy shipping and auditing through the coordinator
# (issue 4 over the fabric): test_pshipping (cmocka; a coordinator process
# from fi_fabric_peer, fedctl as a process) and the command-line
# walk-through with the real binaries (pshipping/cli.sh).
if(NOT TARGET fi_fabric OR NOT TARGET fedctl OR NOT TARGET fedinfer)
  return()
endif()

if(TARGET test_pshipping)
  add_dependencies(test_pshipping fi_fabric_peer fedctl)
  target_compile_definitions(test_pshipping PRIVATE FI_FABRIC_PEER="$<TARGET_FILE:fi_fabric_peer>")
  set_tests_properties(test_pshipping PROPERTIES LABELS asan TIMEOUT 120
    ENVIRONMENT "CMOCKA_MESSAGE_OUTPUT=stdout;FEDCTL=$<TARGET_FILE:fedctl>")
endif()

add_test(NAME pshipping_cli
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/pshipping/cli.sh
                 $<TARGET_FILE:fedinfer> $<TARGET_FILE:fedctl>)
set_tests_properties(pshipping_cli PROPERTIES TIMEOUT 90)
