# golden.cmake - the engine against the float64 numpy reference
# (tests/golden/reference.py). test_golden.c is built and added by
# tests/CMakeLists.txt like every test_*.c; this fragment sets what it needs
# beyond that. Regenerate the data with tests/golden/make_golden.py (needs
# python3 with gguf, numpy, tokenizers); running the test needs no Python.
if(TARGET test_golden)
  set_tests_properties(test_golden PROPERTIES
    TIMEOUT 300
    LABELS "golden;model"
    REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL};${CMAKE_CURRENT_LIST_DIR}/golden/golden.txt;${CMAKE_CURRENT_LIST_DIR}/golden/logits_full.txt")
  # test_golden runs the backend's default precision; these run each of
  # the two 16-bit-quant precisions whatever the default is here: one
  # scale per token (16, held to the tighter tolerances of the engine's
  # most exact mode) and one per block within 2039 for Q4 (12)
  add_test(NAME test_golden_12 COMMAND test_golden)
  set_tests_properties(test_golden_12 PROPERTIES
    ENVIRONMENT "FI_GOLDEN_ACT_BITS=12"
    TIMEOUT 300
    LABELS "golden;model"
    REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL};${CMAKE_CURRENT_LIST_DIR}/golden/golden.txt;${CMAKE_CURRENT_LIST_DIR}/golden/logits_full.txt")
  add_test(NAME test_golden_16 COMMAND test_golden)
  set_tests_properties(test_golden_16 PROPERTIES
    ENVIRONMENT "FI_GOLDEN_ACT_BITS=16"
    TIMEOUT 300
    LABELS "golden;model"
    REQUIRED_FILES "${FEDINFER_DEFAULT_MODEL};${CMAKE_CURRENT_LIST_DIR}/golden/golden.txt;${CMAKE_CURRENT_LIST_DIR}/golden/logits_full.txt")
endif()
