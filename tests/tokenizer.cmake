# test_tokenizer parses outside input (GGUF metadata, arbitrary bytes):
# run it under AddressSanitizer too.
if(TARGET test_tokenizer)
  set_tests_properties(test_tokenizer PROPERTIES LABELS asan)
endif()
