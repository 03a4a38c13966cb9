// The one place that maps runtime values to template arguments. Each macro
// sets a constexpr for the matching case and runs the body; anything else
// throws std::invalid_argument naming the value (the binding turns it into a
// Python ValueError; the Python layer validates first, so this is a backstop).
#pragma once

#include <stdexcept>
#include <string>

#include "kvsplit/params.h"

namespace kvsplit {

[[noreturn]] inline void throw_unsupported(const char* what, long long value) {
  throw std::invalid_argument(std::string("kvsplit: unsupported ") + what + " = " +
                              std::to_string(value));
}

}  // namespace kvsplit

#define KVSPLIT_CASE(VALUE, NAME, ...) \
  case VALUE: {                        \
    constexpr auto NAME = VALUE;       \
    __VA_ARGS__                        \
    break;                             \
  }

#define KVSPLIT_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, ...)                   \
  switch (head_dim) {                                                        \
    KVSPLIT_CASE(64, HEAD_DIM, __VA_ARGS__)                                  \
    KVSPLIT_CASE(128, HEAD_DIM, __VA_ARGS__)                                 \
    KVSPLIT_CASE(256, HEAD_DIM, __VA_ARGS__)                                 \
    KVSPLIT_CASE(512, HEAD_DIM, __VA_ARGS__)                                 \
    default: ::kvsplit::throw_unsupported("head_dim", head_dim);             \
  }

#define KVSPLIT_DISPATCH_KV_SPLIT(kv_split, KV_SPLIT, ...)                   \
  switch (kv_split) {                                                        \
    KVSPLIT_CASE(1, KV_SPLIT, __VA_ARGS__)                                   \
    KVSPLIT_CASE(2, KV_SPLIT, __VA_ARGS__)                                   \
    KVSPLIT_CASE(4, KV_SPLIT, __VA_ARGS__)                                   \
    KVSPLIT_CASE(8, KV_SPLIT, __VA_ARGS__)                                   \
    KVSPLIT_CASE(16, KV_SPLIT, __VA_ARGS__)                                  \
    default: ::kvsplit::throw_unsupported("kv_split", kv_split);             \
  }

#define KVSPLIT_DISPATCH_STATS_FORMAT(format, FORMAT, ...)                   \
  switch (format) {                                                          \
    KVSPLIT_CASE(::kvsplit::StatsFormat::kMaxSum, FORMAT, __VA_ARGS__)       \
    KVSPLIT_CASE(::kvsplit::StatsFormat::kLse, FORMAT, __VA_ARGS__)          \
    default: ::kvsplit::throw_unsupported("stats_format", static_cast<int>(format)); \
  }

// (partial dtype, output dtype) pairs that are compiled: 16-bit partials
// produce their own dtype; float32 partials produce either 16-bit dtype.
#define KVSPLIT_DTYPE_PAIR(in, out) (static_cast<int>(in) * 4 + static_cast<int>(out))
#define KVSPLIT_PAIR_CASE(IN, OUT, PARTIAL, OUTPUT, ...)                     \
  case KVSPLIT_DTYPE_PAIR(IN, OUT): {                                        \
    constexpr auto PARTIAL = IN;                                             \
    constexpr auto OUTPUT = OUT;                                             \
    __VA_ARGS__                                                              \
    break;                                                                   \
  }
#define KVSPLIT_DISPATCH_DTYPES(partial_dtype, out_dtype, PARTIAL, OUTPUT, ...)        \
  switch (KVSPLIT_DTYPE_PAIR(partial_dtype, out_dtype)) {                              \
    KVSPLIT_PAIR_CASE(::kvsplit::DType::kBFloat16, ::kvsplit::DType::kBFloat16,        \
                      PARTIAL, OUTPUT, __VA_ARGS__)                                    \
    KVSPLIT_PAIR_CASE(::kvsplit::DType::kFloat16, ::kvsplit::DType::kFloat16,          \
                      PARTIAL, OUTPUT, __VA_ARGS__)                                    \
    KVSPLIT_PAIR_CASE(::kvsplit::DType::kFloat32, ::kvsplit::DType::kBFloat16,         \
                      PARTIAL, OUTPUT, __VA_ARGS__)                                    \
    KVSPLIT_PAIR_CASE(::kvsplit::DType::kFloat32, ::kvsplit::DType::kFloat16,          \
                      PARTIAL, OUTPUT, __VA_ARGS__)                                    \
    default: ::kvsplit::throw_unsupported("(partial_dtype, out_dtype) pair",           \
                                          KVSPLIT_DTYPE_PAIR(partial_dtype, out_dtype)); \
  }
