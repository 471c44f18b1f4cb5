# Core unit tests that also run in the sanitizer build.
set_tests_properties(test_sampler test_textstream test_model test_sched PROPERTIES LABELS asan)
