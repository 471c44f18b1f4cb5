/*
 * stand_in_driver.c - built as libcuda.so.1 for test_cuda_loader only: a
 * driver library with nothing in it, so that dlopen("libcuda.so.1")
 * succeeds and the CUDA runtime then fails with its own message.
 */
int fi_stand_in_driver;
