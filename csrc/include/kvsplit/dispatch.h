// The one place that maps runtime values to template arguments. Each macro
// runs its body with a constexpr NAME equal to the runtime value, for every
// value of the config.h list it names; anything else sets STATUS to the
// error naming the value. No exceptions: launchers return the status.
#pragma once

#include <type_traits>

#include "kvsplit/config.h"

namespace kvsplit {

// Calls body(std::integral_constant<int, V>{}) for the value V of `List`
// equal to `value`; false if there is none.
template <int... kValues, typename Body>
bool dispatch_int(IntList<kValues...>, int value, Body&& body) {
  return ((value == kValues ? (body(std::integral_constant<int, kValues>{}), true) : false) || ...);
}

}  // namespace kvsplit

#define KVSPLIT_DISPATCH_LIST(LIST, runtime_value, NAME, STATUS, ERROR, ...)                           \
  if (!::kvsplit::dispatch_int(LIST{}, (runtime_value), [&](auto kvsplit_constant_) {                  \
        constexpr int NAME = decltype(kvsplit_constant_)::value;                               \
        __VA_ARGS__                                                                            \
      })) {                                                                                    \
    STATUS = ::kvsplit::fail(ERROR, (runtime_value));                                                \
  }

#define KVSPLIT_DISPATCH_KVSPLIT_KV_SPLIT(kv_split, KV_SPLIT, STATUS, ...)            \
  KVSPLIT_DISPATCH_LIST(::kvsplit::KvSplitKvSplits, kv_split, KV_SPLIT, STATUS,       \
                        ::kvsplit::Error::kKvSplit, __VA_ARGS__)

#define KVSPLIT_DISPATCH_DSPLIT_DEPTH(depth, DEPTH, STATUS, ...) \
  KVSPLIT_DISPATCH_LIST(::kvsplit::DsplitDepths, depth, DEPTH, STATUS, ::kvsplit::Error::kDepth, __VA_ARGS__)

#define KVSPLIT_DISPATCH_FEW_DEPTH(depth, DEPTH, STATUS, ...) \
  KVSPLIT_DISPATCH_LIST(::kvsplit::FewDepths, depth, DEPTH, STATUS, ::kvsplit::Error::kDepth, __VA_ARGS__)

#define KVSPLIT_DISPATCH_FEW_VECTORS(vectors, VECTORS, STATUS, ...)                        \
  KVSPLIT_DISPATCH_LIST(::kvsplit::FewVectors, vectors, VECTORS, STATUS,                   \
                        ::kvsplit::Error::kVectors, __VA_ARGS__)

#define KVSPLIT_CASE(VALUE, NAME, ...) \
  case VALUE: {                        \
    constexpr auto NAME = VALUE;       \
    __VA_ARGS__                        \
    break;                             \
  }

#define KVSPLIT_DISPATCH_FAMILY(family, FAMILY, STATUS, ...)                         \
  switch (family) {                                                                  \
    KVSPLIT_CASE(::kvsplit::Family::kKvSplit, FAMILY, __VA_ARGS__)                   \
    KVSPLIT_CASE(::kvsplit::Family::kDSplit, FAMILY, __VA_ARGS__)                    \
    KVSPLIT_CASE(::kvsplit::Family::kFew, FAMILY, __VA_ARGS__)                       \
    default: STATUS = ::kvsplit::fail(::kvsplit::Error::kFamily, static_cast<int>(family)); \
  }

#define KVSPLIT_DISPATCH_STATS_FORMAT(format, FORMAT, STATUS, ...)                   \
  switch (format) {                                                                  \
    KVSPLIT_CASE(::kvsplit::StatsFormat::kMaxSum, FORMAT, __VA_ARGS__)               \
    KVSPLIT_CASE(::kvsplit::StatsFormat::kLse, FORMAT, __VA_ARGS__)                  \
    default: STATUS = ::kvsplit::fail(::kvsplit::Error::kStatsFormat, static_cast<int>(format)); \
  }

// The partial dtypes, each its own instantiation (the output dtype is a
// runtime switch of the store).
#define KVSPLIT_DISPATCH_PARTIAL_DTYPE(partial_dtype, PARTIAL, STATUS, ...)                  \
  switch (partial_dtype) {                                                                 \
    KVSPLIT_CASE(::kvsplit::DType::kBFloat16, PARTIAL, __VA_ARGS__)                        \
    KVSPLIT_CASE(::kvsplit::DType::kFloat16, PARTIAL, __VA_ARGS__)                         \
    KVSPLIT_CASE(::kvsplit::DType::kFloat32, PARTIAL, __VA_ARGS__)                         \
    default: STATUS = ::kvsplit::fail(::kvsplit::Error::kDtypes, static_cast<int>(partial_dtype)); \
  }

// A group's first load round holds 1..MAX partials (a runtime count), each
// count its own instantiation so that every load is issued before the first
// use. Device code too: there is no status, a count out of range does nothing.
#define KVSPLIT_ROUND_CASE(N, MAX, COUNT, ...) \
  case N:                                      \
    if constexpr (N <= MAX) {                  \
      constexpr int COUNT = N;                 \
      __VA_ARGS__                              \
    }                                          \
    break;
#define KVSPLIT_DISPATCH_FIRST_ROUND(first, MAX, COUNT, ...)                                 \
  switch (first) {                                                                            \
    KVSPLIT_ROUND_CASE(1, MAX, COUNT, __VA_ARGS__) KVSPLIT_ROUND_CASE(2, MAX, COUNT, __VA_ARGS__) \
    KVSPLIT_ROUND_CASE(3, MAX, COUNT, __VA_ARGS__) KVSPLIT_ROUND_CASE(4, MAX, COUNT, __VA_ARGS__) \
    KVSPLIT_ROUND_CASE(5, MAX, COUNT, __VA_ARGS__) KVSPLIT_ROUND_CASE(6, MAX, COUNT, __VA_ARGS__) \
    KVSPLIT_ROUND_CASE(7, MAX, COUNT, __VA_ARGS__) KVSPLIT_ROUND_CASE(8, MAX, COUNT, __VA_ARGS__) \
    KVSPLIT_ROUND_CASE(9, MAX, COUNT, __VA_ARGS__) KVSPLIT_ROUND_CASE(10, MAX, COUNT, __VA_ARGS__) \
    KVSPLIT_ROUND_CASE(11, MAX, COUNT, __VA_ARGS__) KVSPLIT_ROUND_CASE(12, MAX, COUNT, __VA_ARGS__) \
    KVSPLIT_ROUND_CASE(13, MAX, COUNT, __VA_ARGS__) KVSPLIT_ROUND_CASE(14, MAX, COUNT, __VA_ARGS__) \
    KVSPLIT_ROUND_CASE(15, MAX, COUNT, __VA_ARGS__) KVSPLIT_ROUND_CASE(16, MAX, COUNT, __VA_ARGS__) \
    default: break;                                                                           \
  }
