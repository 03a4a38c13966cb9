// The CPU implementation: the same algorithm as merge.cuh, one row at a time.
// K groups each merge every K-th partial in padded batches of 4, then group 0
// combines the others in order, exactly as the kernel does, so that the
// group merge is tested on machines without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "kvsplit/dispatch.h"
#include "kvsplit/host_types.h"
#include "kvsplit/launch.h"
#include "kvsplit/merge_math.h"

namespace kvsplit {
namespace {

constexpr int kLoadUnroll = 4;
constexpr int kMaxKvSplit = 16;

template <DType kDType>
float load_elem(const void* base, int64_t offset) {
  if constexpr (kDType == DType::kFloat32) {
    return static_cast<const float*>(base)[offset];
  } else if constexpr (kDType == DType::kBFloat16) {
    return host::bfloat16_to_float(static_cast<const uint16_t*>(base)[offset]);
  } else {
    return host::float16_to_float(static_cast<const uint16_t*>(base)[offset]);
  }
}

template <DType kDType>
void store_elem(void* base, int64_t offset, float value) {
  if constexpr (kDType == DType::kBFloat16) {
    static_cast<uint16_t*>(base)[offset] = host::float_to_bfloat16(value);
  } else {
    static_assert(kDType == DType::kFloat16, "outputs are 16-bit");
    static_cast<uint16_t*>(base)[offset] = host::float_to_float16(value);
  }
}

template <int kHeadDim, DType kPartial, DType kOut>
void merge_rows(const MergeParams& p, StatsFormat format, int kv_split, int64_t row_begin,
                int64_t row_end) {
  using State = MergeState<kHeadDim>;
  std::vector<State> groups(kv_split);
  float m_in[kLoadUnroll], l_in[kLoadUnroll], o_in[kLoadUnroll][kHeadDim];

  for (int64_t row = row_begin; row < row_end; ++row) {
    int num_splits = static_cast<int>(p.num_splits);
    if (p.split_counts != nullptr) num_splits = std::clamp(p.split_counts[row], 0, num_splits);
    for (int group = 0; group < kv_split; ++group) {
      State& state = groups[group];
      state.reset();
      if (group >= num_splits) continue;
      const int count = (num_splits - group + kv_split - 1) / kv_split;
      const int last = group + (count - 1) * kv_split;
      for (int j0 = 0; j0 < count; j0 += kLoadUnroll) {
        for (int u = 0; u < kLoadUnroll; ++u) {
          const bool live = j0 + u < count;
          const int64_t split = live ? group + (j0 + u) * kv_split : last;
          const float* stat = p.stats + split * p.stats_stride_split + row * p.stats_stride_row;
          l_in[u] = format == StatsFormat::kMaxSum ? stat[1] : 1.f;
          m_in[u] = live ? stat[0] * p.log2_scale : neg_inf();
          const int64_t base = split * p.o_stride_split + row * p.o_stride_row;
          for (int d = 0; d < kHeadDim; ++d) o_in[u][d] = load_elem<kPartial>(p.partial_o, base + d);
        }
        state.merge_batch(m_in, l_in, [&](int j, int d) { return o_in[j][d]; });
      }
    }
    State& state = groups[0];
    for (int group = 1; group < kv_split; ++group) {
      state.combine(groups[group].m, groups[group].l, groups[group].acc, 1);
    }
    const float sink_log2 = p.sinks != nullptr ? p.sinks[row % p.heads] * kLog2E : neg_inf();
    float out[kHeadDim], log2_total;
    const float total = state.finalize(sink_log2, out, log2_total);
    for (int d = 0; d < kHeadDim; ++d) store_elem<kOut>(p.out, row * p.out_stride_row + d, out[d]);
    if (p.out_stats != nullptr) {
      if (format == StatsFormat::kMaxSum) {
        p.out_stats[2 * row] = state.m * p.export_scale;
        p.out_stats[2 * row + 1] = total;
      } else {
        p.out_stats[row] = log2_total * p.export_scale;
      }
    }
  }
}

}  // namespace

void merge_cpu(const MergeParams& params, const KernelChoice& choice) {
  if (choice.kv_split < 1 || choice.kv_split > kMaxKvSplit) {
    throw_unsupported("kv_split", choice.kv_split);
  }
  // Rows are independent; large calls are spread over the host's cores.
  const int64_t work = params.rows * std::max<int64_t>(params.num_splits, 1) * choice.head_dim;
  const int64_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const int64_t workers = std::clamp<int64_t>(work >> 22, 1, std::min(hardware, params.rows));
  KVSPLIT_DISPATCH_HEAD_DIM(choice.head_dim, kHeadDim, {
    KVSPLIT_DISPATCH_DTYPES(choice.partial_dtype, choice.out_dtype, kPartial, kOut, {
      auto run = [&](int64_t begin, int64_t end) {
        merge_rows<kHeadDim, kPartial, kOut>(params, choice.stats_format, choice.kv_split, begin,
                                             end);
      };
      if (workers <= 1) {
        run(0, params.rows);
      } else {
        std::vector<std::thread> threads;
        const int64_t chunk = (params.rows + workers - 1) / workers;
        for (int64_t begin = 0; begin < params.rows; begin += chunk) {
          threads.emplace_back(run, begin, std::min(params.rows, begin + chunk));
        }
        for (auto& thread : threads) thread.join();
      }
    })
  })
}

}  // namespace kvsplit
