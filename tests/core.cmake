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
