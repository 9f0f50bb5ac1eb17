/* Conventions shared by every C source under app/backends/cpu/csrc/; the Python side is
 * app/backends/cpu/loader.py (read its module docstring first).
 *
 * - Element types have one set of codes, defined here only. Python never hard-codes them:
 *   it asks the loaded library (app_native_dtype_code("bfloat16") -> APP_DT_BF16).
 * - A kernel takes its arguments as one struct, declared with APP_NATIVE_STRUCT from an
 *   X-macro field list; APP_NATIVE_STRUCT_LAYOUT exports the struct's size, field count and
 *   every field's offset, and the loader checks them against the ctypes.Structure that
 *   mirrors it before anything is called.
 * - Each library exports its ABI version (APP_NATIVE_LIBRARY, in exactly one of its sources);
 *   the loader refuses a library whose version is not the one its spec expects. Bump it on
 *   every change to an exported function's signature or meaning.
 * - Sources are built with -fvisibility=hidden: only APP_NATIVE_EXPORT names are visible.
 */
#ifndef APP_NATIVE_H
#define APP_NATIVE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define APP_NATIVE_EXPORT __attribute__((visibility("default")))

/* Element type codes (the math is float32 whatever the storage type). */
enum app_native_dtype { APP_DT_F32 = 0, APP_DT_BF16 = 1, APP_DT_F16 = 2 };

static inline int64_t app_native_elem_size(int32_t dt) { return dt == APP_DT_F32 ? 4 : 2; }

/* The library's ABI version and dtype codes, exported: use once per library. */
#define APP_NATIVE_LIBRARY(abi_version)                                       \
  APP_NATIVE_EXPORT int64_t app_native_abi_version(void) { return (abi_version); } \
  APP_NATIVE_EXPORT int32_t app_native_dtype_code(const char* name) {          \
    if (strcmp(name, "float32") == 0) return APP_DT_F32;                       \
    if (strcmp(name, "bfloat16") == 0) return APP_DT_BF16;                     \
    if (strcmp(name, "float16") == 0) return APP_DT_F16;                       \
    return -1;                                                                 \
  }

/* An argument struct from an X-macro list of (type, name) fields:
 *   #define MY_ARGS(X) X(const void*, q) X(int64_t, n) X(float, scale)
 *   APP_NATIVE_STRUCT(my_args, MY_ARGS)          -- typedef struct my_args {...} my_args;
 *   APP_NATIVE_STRUCT_LAYOUT(my_args, MY_ARGS)   -- in one source of the library: exports
 *       int64_t app_native_layout_my_args(const char* field): the struct's size for NULL,
 *       its field count for "#fields", a field's offset for its name, -1 for anything else.
 * Use only fixed-size types (int64_t, int32_t, float, double, pointers). */
#define APP_NATIVE_FIELD_DECL_(type, name) type name;
#define APP_NATIVE_FIELD_COUNT_(type, name) +1
#define APP_NATIVE_FIELD_OFFSET_(type, name) \
  if (strcmp(field, #name) == 0) return (int64_t)offsetof(app_native_struct_, name);
#define APP_NATIVE_STRUCT(sname, FIELDS) \
  typedef struct sname { FIELDS(APP_NATIVE_FIELD_DECL_) } sname;
#define APP_NATIVE_STRUCT_LAYOUT(sname, FIELDS)                         \
  APP_NATIVE_EXPORT int64_t app_native_layout_##sname(const char* field) { \
    typedef sname app_native_struct_;                                   \
    if (field == NULL) return (int64_t)sizeof(sname);                   \
    if (strcmp(field, "#fields") == 0) return 0 FIELDS(APP_NATIVE_FIELD_COUNT_); \
    FIELDS(APP_NATIVE_FIELD_OFFSET_)                                    \
    return -1;                                                          \
  }

#endif /* APP_NATIVE_H */
