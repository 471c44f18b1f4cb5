# Core unit tests that also run in the sanitizer build.
set_tests_properties(test_sampler test_textstream test_model test_sched PROPERTIES LABELS asan)
# The scheduler on the default model (batched == alone, 512-token prefix
# reuse, KV pressure).
if(TARGET test_sched_model)
  set_tests_properties(test_sched_model PROPERTIES
    TIMEOUT 300
    LABELS "model"
    REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL}")
endif()
# fedinfer run's sampling flags: OpenAI's penalties change a greedy answer;
# out of range they are refused (exit 2) naming the flag.
if(TARGET fedinfer)
  add_test(NAME cli_run_penalties COMMAND sh -c
    "m='${FEDINFER_DEFAULT_MODEL}'; f='$<TARGET_FILE:fedinfer>'
     a=$($f run -m \"$m\" -t 1 --raw -n 10 --temp 0 '1, 2, 3,') || exit 1
     b=$($f run -m \"$m\" -t 1 --raw -n 10 --temp 0 --frequency-penalty 2 --presence-penalty 2 '1, 2, 3,') || exit 1
     test -n \"$a\" && test \"$a\" != \"$b\" || { echo \"same answer: $a\"; exit 1; }
     $f run -m \"$m\" --presence-penalty 3 x 2>err.txt; test $? = 2 && grep -q -- --presence-penalty err.txt")
  set_tests_properties(cli_run_penalties PROPERTIES LABELS "model" REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL}")
endif()
