/* A tiny native library for tests/backends/cpu/test_child_verdict.py: one function that
 * answers and one that executes an undefined instruction (ud2: SIGILL), as a kernel built for
 * instructions the CPU does not have would. */
#include "app_native.h"

APP_NATIVE_LIBRARY(1)

APP_NATIVE_EXPORT int32_t child_test_answer(void) { return 42; }

APP_NATIVE_EXPORT int32_t child_test_crash(void) {
  __builtin_trap();
  return 0;
}
