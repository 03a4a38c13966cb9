// The Few family: merges of a few states (two to sixteen), each thread alone.
//
// At N = 2..16 the merge is an elementwise pass over N inputs, and the
// KvSplit and DSplit kernels pay for machinery it does not need (groups
// folded through shared memory or shuffles, barriers, a grid capped at two
// CTAs per SM with a loop over bands). Here a thread owns `vectors` 16-byte
// vectors of one row (few_geometry.h: lane, lane + L, ... of its V vectors)
// and merges every state of them itself. Per round of `depth` states it
// issues every partial's and every stat's load before any arithmetic, weighs
// the states once for all its vectors (the weights depend on the stats
// alone), and stores each vector once. No shared memory and no barrier; the
// only shuffles are the per-group FP8 amax's, the only sync an in-place
// export's __syncwarp. Rows follow one another across threads and CTAs (R * L
// threads in all), and CTAs shrink until one token's rows spread over the
// SMs (make_few_launch). A row of more states than `depth` (split counts,
// indptr) takes several rounds: any count works, rescaled once a round.
//
// Order of combination (merge_cpu.cpp mirrors it): per vector, rounds of
// depth = few_depth(num_splits, vectors) states begin, begin + 1, ...; each
// round's states in merge_batch's of up to kFewMathBatch (a batch's max
// first, the running state rescaled once, then its states in order), slots
// past the row's count weighing 0.
//
// The depth and `vectors` are template arguments (a thread's loads live in
// registers): the pairs of config.h's FewDepths x FewVectors that
// few_loads_fit, seven per (partial dtype, stats format), each as four lean
// kernels (one per output dtype but e4m3fnuz) and the general one
// (few_lean_kernel below says which calls take which); with LSE stats, the
// depth-2 pairs also as TensorRT-LLM's instance (few_kernel's kRequests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kvsplit/device_common.cuh"
#include "kvsplit/dispatch.h"
#include "kvsplit/few_geometry.h"
#include "kvsplit/merge_math.h"
#include "kvsplit/params.h"

namespace kvsplit {

// One round: up to kDepth states (`live` of them; the rest weigh 0 and load
// nothing) of a thread's kVectors vectors, `vector_step` elements apart.
// Every load of the round is issued before the first use; the states are
// folded in batches of kFewMathBatch.
template <int kDepth, int kVectors, DType kPartial, StatsFormat kFormat, int kElems,
          bool kPairs = false, int kLoadBytes = kBytesPerThread>
__device__ __forceinline__ void merge_few_round(MergeState<kElems>& state,
                                                const typename CudaType<kPartial>::type* o,
                                                const float* s, int live, int64_t o_step,
                                                int64_t s_step, int vector_step,
                                                const bool (&holds)[kVectors], float log2_scale,
                                                float empty_stat) {
  constexpr int kVec = kLoadBytes / elem_bytes<kPartial>();
  static_assert(kElems == kVec * kVectors, "a thread's state spans its vectors");
  Packed<kLoadBytes> packed[kDepth][kVectors];
  float m_in[kDepth], l_in[kDepth];
  // State addresses by increments: written as o + j * o_step, ptxas reloaded
  // the base and stride from constant memory for each predicated load, which
  // spread the issue of sixteen states' loads over 300 instructions (sm_90a).
  const auto* state_o = o;
  const float* stat = s;
#pragma unroll
  for (int j = 0; j < kDepth; ++j, state_o += o_step, stat += s_step) {
    const bool on = j < live;
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      packed[j][u] = on && holds[u] ? load_packed<kLoadBytes>(state_o + u * vector_step)
                                    : Packed<kLoadBytes>{};
    }
    const float m_raw = on ? __ldg(stat) : neg_inf();
    l_in[j] = kFormat == StatsFormat::kMaxSum ? (on ? __ldg(stat + 1) : 0.f) : 1.f;
    m_in[j] = m_raw != empty_stat ? m_raw : neg_inf();
    // (max, sum) pairs of normalised partials (MergeParams::pair_stats): LSE = max + ln(sum).
    if constexpr (kPairs) {
      if (on) m_in[j] += logf(__ldg(stat + 1));
    }
  }
  constexpr int kBatch = kDepth < kFewMathBatch ? kDepth : kFewMathBatch;
#pragma unroll
  for (int b = 0; b < kDepth; b += kBatch) {
    float m_batch[kBatch], l_batch[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      m_batch[j] = m_in[b + j];
      l_batch[j] = l_in[b + j];
    }
    state.merge_batch(
        m_batch, l_batch,
        [&](int j, int e) { return unpack<kPartial>(packed[b + j][e / kVec], e % kVec); },
        log2_scale);
  }
}

// kRequests: the instance for TensorRT-LLM's calls (two LSE splits: depth 2),
// which alone reads per-request ops and (max, sum) pair stats; compiled into
// the others, that code raised their registers by up to half (sm_90a: 56 to
// 71, 128 to 193) and cost a 32768-row pass 15 %.
template <DType kPartial, StatsFormat kFormat, int kDepth, int kVectors, bool kRequests = false>
__global__ void __launch_bounds__(kFewMaxCtaThreads, KVSPLIT_FEW_MIN_CTAS)
    few_kernel(const FewGeometry geo, const MergeParams p) {
  constexpr int kVec = kBytesPerThread / elem_bytes<kPartial>();
  constexpr int kElems = kVec * kVectors;
  using Partial = typename CudaType<kPartial>::type;

  // Below 2^31 (make_few_launch): the row of a pass and the lane by one multiply-high.
  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t row_in_pass = geo.lanes.div(thread);
  const int lanes = static_cast<int>(geo.lanes.divisor);
  const int lane = static_cast<int>(thread - row_in_pass * geo.lanes.divisor);
  bool holds[kVectors];  // the step's vector lies inside the row
#pragma unroll
  for (int u = 0; u < kVectors; ++u) holds[u] = lane + u * lanes < geo.row_vectors;

  pdl_wait();
  const float out_scale = load_out_scale(p);
  // Passes are uniform over the grid: every thread of a warp takes each one
  // (the per-group shuffles and the in-place __syncwarp need the whole warp).
  for (int64_t first = 0; first < p.rows; first += geo.rows_per_pass) {
    const int64_t row = first + row_in_pass;
    // The row's place and states; a plain call (FewGeometry::plain) skips
    // the lookups, so that little stands between the row and its loads.
    RowIndex at;
    bool active;
    SplitRange splits{0, 0};
    int64_t o_row, s_row, out_row;
    int64_t head = 0;  // the row's sink's index (read only with sinks)
    if (geo.plain) {
      at.head = row;
      active = row < p.rows;
      splits.count = active ? static_cast<int>(p.num_splits) : 0;
      o_row = row * p.o_row.head;
      s_row = row * p.stats_row.head;
      out_row = row * p.out_row.head;
      if (p.sinks != nullptr) head = split_row(p, row).head;
    } else {
      // One (batch, token, head) split serves the strides, the mask, the
      // states and the sink (the helpers of params.h would split a flat row
      // again for each).
      const RowIndex split = split_row(p, row);
      const int64_t token = split.batch * p.seqlen + split.token;
      at = p.flat_rows ? RowIndex{0, 0, row} : split;
      head = split.head;
      active = row < p.rows &&
               (p.row_mask == nullptr || p.row_mask[token * p.row_mask_stride] != 0);
      if (active) splits = row_splits_of_token(p, token, row);
      if constexpr (kRequests) {
        if (active && p.request_starts != nullptr) active = request_splits(p, token, splits);
      }
      o_row = p.o_row.at(at);
      s_row = p.stats_row.at(at);
      out_row = p.out_row.at(at);
    }
    o_row += lane * kVec;
    MergeState<kElems> state;
    state.reset();
    const float* pass_stats = nullptr;
    if (splits.pass) {
      // A pass-through row: its one split as it is (load_pass_through, per vector).
      pass_stats = p.stats + (splits.begin * p.stats_stride_split + s_row);
      state.set_single(kFormat == StatsFormat::kMaxSum ? __ldg(pass_stats + 1) : 1.f);
      const Partial* o = static_cast<const Partial*>(p.partial_o) +
                         (splits.begin * p.o_stride_split + o_row);
#pragma unroll
      for (int u = 0; u < kVectors; ++u) {
        if (!holds[u]) continue;
        const auto packed = load_packed<kBytesPerThread>(o + u * lanes * kVec);
#pragma unroll
        for (int v = 0; v < kVec; ++v) state.acc[u * kVec + v] = unpack<kPartial>(packed, v);
      }
    } else {
      const Partial* o = static_cast<const Partial*>(p.partial_o) +
                         (splits.begin * p.o_stride_split + o_row);
      const float* s = p.stats + (splits.begin * p.stats_stride_split + s_row);
      for (int done = 0; done < splits.count; done += kDepth) {
        merge_few_round<kDepth, kVectors, kPartial, kFormat, kElems, kRequests>(
            state, o, s, splits.count - done, p.o_stride_split, p.stats_stride_split,
            lanes * kVec, holds, p.log2_scale, p.empty_stat);
        o += kDepth * p.o_stride_split;
        s += kDepth * p.stats_stride_split;
      }
    }
    // Every load of this pass is done: the next kernel may start its prologue.
    pdl_trigger();

    const float sink_log2 = p.sinks != nullptr && active && !splits.pass
                                ? __ldg(p.sinks + head) * kLog2E
                                : neg_inf();
    float out[kElems], log2_rel;
    const float total = state.finalize(sink_log2, p.log2_scale, out, log2_rel);
    // An in-place export overwrites split 0's stats, which every thread of
    // the row reads: they are all in this warp (check_call_rules).
    if (p.stats_in_place) __syncwarp();
    // One vector a step, the next one shifted into out[0, kVec) (static
    // indices: out stays in registers), so that the store's code (branches
    // over five output dtypes, FP8 scaling) is compiled once, not per vector.
#pragma unroll 1
    for (int u = 0; u < kVectors; ++u) {
      float vector[kVec];
#pragma unroll
      for (int v = 0; v < kVec; ++v) vector[v] = out[v];
#pragma unroll
      for (int e = 0; e + kVec < kElems; ++e) out[e] = out[e + kVec];
      const int col = (lane + u * lanes) * kVec;
      const bool stores = active && col < geo.row_vectors * kVec;
      // A group's lanes are consecutive threads of one step of one row (check_call_rules).
      if (is_fp8(p.out_dtype)) scale_fp8(p, vector, at, col, stores, 0xffffffffu, out_scale);
      if (stores) store_any(p.out_dtype, p.out, out_row + col, vector);
    }
    if (active && lane == 0 && p.out_stats != nullptr) {
      export_stats<kFormat>(p, state, at, total, sink_log2, log2_rel, pass_stats);
      if constexpr (kRequests) {  // the pair's sum: 1, or as it is
        p.out_stats[p.out_stats_row.at(at) + 1] = pass_stats != nullptr ? pass_stats[1] : 1.f;
      }
    }
  }
}

// The bytes of a state's row a lean thread loads: 16, but 8 for 16-bit
// partials where the thread writes float32 or holds sixteen states a round.
// Float32: each thread then stores its 16 bytes in one access, a warp's store
// 512 contiguous bytes; with 16-byte loads a thread had 32 bytes to store, and
// trading halves with its lane pair so that every store wrote whole sectors
// still spread each store over twice the cache lines (4096 x 2 x 512: 4.91
// against 4.14 us, benchmarks/lab/lab_store.py). Sixteen states: a round holds
// half the registers, and more threads an SM issue their loads (float32 from
// sixteen states ran 0.1-0.4 us under bf16 at 512 rows once it took 8 bytes).
constexpr int few_lean_vector_bytes(DType partial, DType out, int depth) {
  return elem_bytes(partial) == 2 && (out == DType::kFloat32 || depth >= kFewMaxDepth)
             ? 8
             : kBytesPerThread;
}

// The lean kernel's parameters: what it reads of MergeParams and FewGeometry,
// with 32-bit row strides (few_lean_call checks that every row offset fits),
// in 144 bytes, the fields its first loads wait for in the first 112 (the
// packed depth-4 instance's lanes_log2 at 108; the packed pair takes
// FewPackedParams, below). Taking
// MergeParams itself (920 bytes with the geometry, these fields spread over
// it) cost a 5-10 MB merge 0.30-0.36 us with identical machine code
// (benchmarks/lab/lab_split.py, m-base against split1).
struct FewLeanParams {
  const void* partial_o;
  const float* stats;
  int64_t o_split;  // elements from one state to the next
  int64_t s_split;  // floats
  FastDivmod lanes;  // threads a row
  FastDivmod heads;  // row = token * heads + head
  int32_t rows;
  int32_t num_splits;
  int32_t o_token, o_head;
  int32_t s_token, s_head;
  float log2_scale;
  float empty_stat;
  void* out;
  int32_t out_token, out_head;
  int32_t row_vectors;  // vectors of a row (few_lean_vector_bytes each)
  int32_t lanes_log2;  // log2 of lanes, in packed calls (few_packed_call); else -1
  float* out_stats;
  int32_t out_stats_token, out_stats_head;
  const float* out_scale;
  bool stats_in_place;
  float export_scale;
};
static_assert(sizeof(FewLeanParams) <= 144, "the lean kernel's parameters stay compact");

// The packed pair's parameters (few_packed_pair_kernel; also the packed
// depth-4 instance's at decode sizes, few_packed_quad_kernel): only the
// fields they read, in the two 64-byte lines of the constant bank that the
// prologue reads before its loads (kernel parameters start at offset 0x210:
// the first line holds 48 bytes of them). A parameter read after the loads
// from a line that nothing read before them waits for that line: on
// FewLeanParams, whose stats export and output fields lie past the
// prologue's lines, the packed pair took 0.04-0.06 us more a one-token
// launch than on a block of one line (benchmarks/lab/lab_fixed.py: product,
// pk1l and hlate against hand16). The other lean instances keep
// FewLeanParams: the general one's prologue reads more than two lines hold
// (those fields placed by line cost its 3-18 MB merges 3 %), and the packed
// depth-4 instance took 3.2-5.3 MB merges 0.05 us longer on this block
// (benchmarks.md, what a small launch pays for). Field names are
// FewLeanParams' (one head a token: the token strides are the row strides).
struct FewPackedParams {
  // 0x210
  const void* partial_o;
  const float* stats;
  int64_t o_split;  // elements from one state to the next
  int64_t s_split;  // floats
  void* out;
  float* out_stats;
  // 0x240
  int32_t rows;
  int32_t lanes_log2;  // log2 of the threads a row
  int32_t s_token;  // floats from one row's stats to the next
  int32_t out_stats_token;
  float log2_scale;
  float empty_stat;
  float export_scale;
  int32_t num_splits;
  const float* out_scale;
};
static_assert(sizeof(FewPackedParams) <= 112 && offsetof(FewPackedParams, rows) == 48,
              "the packed pair's parameters in two lines of the constant bank");

// The packed pair's block for rows of a count of threads that is not a power
// of two (head dims 80, 96, 192, 576 ...), in calls of decode size
// (few_packed_small_call): FewPackedParams, then the divisor that finds a
// thread's row (one multiply-high and a shift), in the same second line
// (lanes_log2 is -1). Larger such calls take the pair instance on (token,
// head) strides (two divisions and four row offsets before the first load),
// which was 1 % faster at 32 MB; at one token the divisor took 0.045 us less
// (1 x 128 x 576: 1.50 against 1.55 us, H100).
struct FewPackedDivParams : FewPackedParams {
  FastDivmod lanes;  // threads a row
};
static_assert(sizeof(FewPackedDivParams) <= 112,
              "the divided packed pair's parameters in the same two lines");

// The lean kernel: the calls engines make most, with nothing else in the
// way. Every row merges all num_splits states (no row mask, split counts,
// indptr or pass-through rows), rows are (token, head) with a stride each per
// tensor, no sinks, no per-group FP8 scales, and one pass of the grid covers
// the call, whose states fit one round (few_lean_call). The general kernel
// serves the same calls with the same results (the same round); what it adds
// for the others (rounds and passes in loops, 64-bit row arithmetic,
// branches to the pass-through rows, sinks, output-dtype branches and FP8
// scaling) costs a decode-sized launch about half a microsecond and a large
// L2-resident one over half its time (benchmarks/lab/lab_fixed.py). Its body
// is a device function so that the kernel lab can build it under other
// launch bounds.
// The output dtype is a template argument (kOut; FP8 with the call's
// per-tensor scale or none), so that its store is straight-line code:
// branches on a runtime dtype at the end of a merge this short cost each
// launch 0.1-0.2 us (benchmarks/lab/lab_outputs.py).
// kPair: the instance for calls of exactly two states at one vector a thread
// (few_pair_call), the commonest merge engines make. Its threads past the
// rows leave first, so that no load waits on a predicate, and its round is
// written out for two states: the same operations in the same order as
// merge_batch's on a fresh state, so the same bits.
// kPacked: the instance for calls whose rows lie packed one after another in
// the partials and the output, a power-of-two count of threads a row
// (few_packed_call), at one vector a thread: a thread's row is a shift of its
// index and its offset in both tensors the index times the vector, so that
// its first load waits on 13 instructions instead of 39 (sm_90a; two
// divisions and the (token, head) offsets: benchmarks/lab/lab_fixed.py's
// `pair` against `product`). Its threads past the rows leave first too.
// kLoadBytes: the bytes of a state's row a thread loads (the kernel lab
// tries others). Params: FewLeanParams, or the packed pair's FewPackedParams
// (FewPackedDivParams where a row's threads are not a power of two: its row
// a quotient, not a shift).
template <DType kPartial, StatsFormat kFormat, int kDepth, int kVectors, DType kOut,
          bool kPair = false, bool kPacked = false,
          int kLoadBytes = few_lean_vector_bytes(kPartial, kOut, kDepth), class Params>
__device__ __forceinline__ void few_lean_merge(const Params& p) {
  static_assert(!kPair || (kDepth == 2 && kVectors == 1), "a pair is two states, one vector");
  static_assert(!kPacked || kVectors == 1, "packed rows are one vector a thread");
  constexpr bool kLeaveFirst = kPair || kPacked;  // no thread past the rows stays
  constexpr int kVec = kLoadBytes / elem_bytes<kPartial>();
  constexpr int kElems = kVec * kVectors;
  using Partial = typename CudaType<kPartial>::type;

  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t row;
  int lanes, lane;
  int32_t token = 0, head = 0;  // the general rows' (packed rows need only the row)
  // Packed rows of a power-of-two count of threads: the row by a shift; any
  // other row (FewPackedDivParams, FewLeanParams) by the lanes' divisor.
  if constexpr (kPacked && !std::is_same_v<Params, FewPackedDivParams>) {
    row = thread >> p.lanes_log2;
    lanes = 1 << p.lanes_log2;
    lane = static_cast<int>(thread - (row << p.lanes_log2));
  } else {
    row = p.lanes.div(thread);
    lanes = static_cast<int>(p.lanes.divisor);
    lane = static_cast<int>(thread - row * p.lanes.divisor);
    if constexpr (!kPacked) {
      token = static_cast<int32_t>(p.heads.div(row));
      head = static_cast<int32_t>(row - token * p.heads.divisor);
    }
  }
  const bool active = row < static_cast<uint32_t>(p.rows);
  bool holds[kVectors];  // one vector of a row of `lanes` (few_threads_per_row)
#pragma unroll
  for (int u = 0; u < kVectors; ++u) {
    if constexpr (kLeaveFirst) {
      holds[u] = true;
    } else {
      holds[u] = lane + u * lanes < p.row_vectors;
    }
  }

  if (kLeaveFirst && !active) return;
  pdl_wait();
  // Issued before the merge's loads so that its latency hides behind theirs.
  const float out_scale = is_fp8(kOut) && p.out_scale != nullptr ? __ldg(p.out_scale) : 1.f;
  // Packed: the row's first element is row * lanes * kVec (few_packed_call),
  // below 2^31 (few_lean_call).
  int32_t o_at, s_at;
  if constexpr (kPacked) {
    o_at = static_cast<int32_t>(thread) * kVec;
    s_at = static_cast<int32_t>(row) * p.s_token;
  } else {
    o_at = token * p.o_token + head * p.o_head + lane * kVec;
    s_at = token * p.s_token + head * p.s_head;
  }
  const Partial* o = static_cast<const Partial*>(p.partial_o) + o_at;
  const float* s = p.stats + s_at;
  MergeState<kElems> state;
  if constexpr (kPair) {
    const auto x = load_packed<kLoadBytes>(o), y = load_packed<kLoadBytes>(o + p.o_split);
    const float raw0 = __ldg(s), raw1 = __ldg(s + p.s_split);
    float l0 = 1.f, l1 = 1.f;
    if constexpr (kFormat == StatsFormat::kMaxSum) {
      l0 = __ldg(s + 1);
      l1 = __ldg(s + p.s_split + 1);
    }
    pdl_trigger();
    const float m0 = raw0 != p.empty_stat ? raw0 : neg_inf();
    const float m1 = raw1 != p.empty_stat ? raw1 : neg_inf();
    // merge_batch from reset(): the fresh state's weight is 0, so its l and
    // accumulators enter as +0.
    state.m = max_keep_nan(m0, m1);
    const float offset = weight_offset(state.m);
    const float w0 = MergeState<kElems>::weight(m0, offset, p.log2_scale);
    const float w1 = MergeState<kElems>::weight(m1, offset, p.log2_scale);
    state.l = __fmaf_rn(w1, l1, __fmaf_rn(w0, l0, 0.f));
#pragma unroll
    for (int v = 0; v < kElems; ++v) {
      state.acc[v] = __fmaf_rn(w1, unpack<kPartial>(y, v),
                               __fmaf_rn(w0, unpack<kPartial>(x, v), 0.f));
    }
  } else {
    state.reset();
    // One round: the call's states fit it (few_lean_call). A loop over further
    // rounds would hold 8-57 more registers a thread through the first (ptxas,
    // sm_90a: 55 against 32 for two states and one vector, 108 against 56 for
    // four states and two vectors), fewer CTAs an SM at large row counts.
    merge_few_round<kDepth, kVectors, kPartial, kFormat, kElems, false, kLoadBytes>(
        state, o, s, active || kLeaveFirst ? p.num_splits : 0, p.o_split, p.s_split,
        lanes * kVec, holds, p.log2_scale, p.empty_stat);
    pdl_trigger();
  }

  float out[kElems], log2_rel;
  const float total = kFormat == StatsFormat::kLse
                          ? state.finalize_lse(out, log2_rel)
                          : state.finalize(neg_inf(), p.log2_scale, out, log2_rel);
  // As in few_kernel; the pair and packed instances serve no in-place export.
  if constexpr (!kLeaveFirst) {
    if (p.stats_in_place) __syncwarp();
  }
  // The row's stats, from the thread at column 0.
  const auto export_row = [&] {
    int32_t at;
    if constexpr (kPacked) {
      at = static_cast<int32_t>(row) * p.out_stats_token;
    } else {
      at = token * p.out_stats_token + head * p.out_stats_head;
    }
    write_stats<kFormat>(p.out_stats + at, state, total, neg_inf(), log2_rel, p.log2_scale,
                         p.export_scale, nullptr);
  };
  const bool exports = active && lane == 0 && p.out_stats != nullptr;
  if (!active) return;
  int32_t out_row = 0;  // (packed rows: the thread's index times the vector, below)
  if constexpr (!kPacked) out_row = token * p.out_token + head * p.out_head;
  // FP8: value / scale, saturated by the conversion (scale_fp8 without groups).
  const float inverse_scale = is_fp8(kOut) ? 1.f / out_scale : 1.f;
#pragma unroll
  for (int u = 0; u < kVectors; ++u) {
    if (!holds[u]) continue;
    float vector[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) vector[v] = out[u * kVec + v];
    const int32_t at = kPacked ? static_cast<int32_t>(thread) * kVec
                               : out_row + (lane + u * lanes) * kVec;
    if constexpr (is_fp8(kOut)) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) vector[v] = fp8_prepare(vector[v], inverse_scale);
    }
    store_out<kVec, kOut>(p.out, at, vector);
  }
  if (exports) export_row();
}

template <DType kPartial, StatsFormat kFormat, int kDepth, int kVectors, DType kOut,
          bool kPair = false, bool kPacked = false>
__global__ void __launch_bounds__(kFewMaxCtaThreads, KVSPLIT_FEW_MIN_CTAS)
    few_lean_kernel(const FewLeanParams p) {
  few_lean_merge<kPartial, kFormat, kDepth, kVectors, kOut, kPair, kPacked>(p);
}

// The lean kernel's packed pair (few_packed_call of a pair), on its own
// parameter block.
template <DType kPartial, StatsFormat kFormat, DType kOut>
__global__ void __launch_bounds__(kFewMaxCtaThreads, KVSPLIT_FEW_MIN_CTAS)
    few_packed_pair_kernel(const FewPackedParams p) {
  few_lean_merge<kPartial, kFormat, 2, 1, kOut, true, true>(p);
}

// The same for rows whose count of threads is not a power of two (calls of
// decode size).
template <DType kPartial, StatsFormat kFormat, DType kOut>
__global__ void __launch_bounds__(kFewMaxCtaThreads, KVSPLIT_FEW_MIN_CTAS)
    few_packed_pair_div_kernel(const FewPackedDivParams p) {
  few_lean_merge<kPartial, kFormat, 2, 1, kOut, true, true>(p);
}

// The packed depth-4 instance (three or four states) of a call of at most one
// smallest CTA an SM (few_packed_small_call) on the packed pair's block. A
// larger call keeps FewLeanParams: on this block it took 0.04-0.06 us longer
// at 3.2-5.3 MB (H100), though its machine code differed only in constant
// offsets and instruction order.
template <DType kPartial, StatsFormat kFormat, DType kOut>
__global__ void __launch_bounds__(kFewMaxCtaThreads, KVSPLIT_FEW_MIN_CTAS)
    few_packed_quad_kernel(const FewPackedParams p) {
  few_lean_merge<kPartial, kFormat, 4, 1, kOut, false, true>(p);
}

// Whether a packed call of `rows` rows of `lanes` threads runs at most one
// smallest CTA on each SM (decode sizes): there each thread's read of a
// constant line that nothing read before its loads is on the path to its
// store.
inline bool few_packed_small_call(int64_t rows, int lanes, int sm_count) {
  return rows * lanes <= int64_t{sm_count} * kFewMinCtaThreads;
}

// Row strides over (token, head) with token = batch * seqlen + token, or
// false where the batch stride is not seqlen token strides.
inline bool fold_batches(const RowStrides& s, int64_t batches, int64_t seqlen, RowStrides& folded) {
  if (seqlen == 1) {
    folded = RowStrides{0, s.batch, s.head};
  } else if (batches <= 1 || s.batch == seqlen * s.token) {
    folded = RowStrides{0, s.token, s.head};
  } else {
    return false;
  }
  return true;
}

// Whether every row offset of a tensor of `tokens` x `heads` rows of
// `row_elems` elements with row strides `s` fits 32 bits.
inline bool row_offsets_fit(const RowStrides& s, int64_t tokens, int64_t heads, int64_t row_elems) {
  const auto span = [](int64_t count, int64_t stride) {
    return (count - 1) * (stride < 0 ? -stride : stride);
  };
  return span(tokens, s.token) + span(heads, s.head) + row_elems <= INT32_MAX;
}

// Whether a call (after flatten_rows) of `threads` threads takes the lean
// kernel; if so, `lean` is the call with every tensor's rows at (0, token,
// head), each row's offsets within 32 bits, and `heads` the heads per token.
inline bool few_lean_rows(const MergeParams& p, int64_t threads, MergeParams& lean,
                          uint32_t& heads) {
  if (p.row_mask != nullptr || p.split_counts != nullptr || p.indptr != nullptr ||
      !lean_epilogue(p) || !has_lean_instance(p.out_dtype) ||
      p.request_starts != nullptr || p.pair_stats ||
      threads > kFewMaxGridThreads || p.heads < 1 || p.heads > INT32_MAX || p.seqlen < 1) {
    return false;
  }
  lean = p;
  if (p.flat_rows) {
    heads = 1;
    lean.o_row = RowStrides{0, p.o_row.head, 0};
    lean.stats_row = RowStrides{0, p.stats_row.head, 0};
    lean.out_row = RowStrides{0, p.out_row.head, 0};
    lean.out_stats_row = RowStrides{0, p.out_stats_row.head, 0};
    return true;
  }
  heads = static_cast<uint32_t>(p.heads);
  const int64_t batches = p.rows / (p.seqlen * p.heads);
  return fold_batches(p.o_row, batches, p.seqlen, lean.o_row) &&
         fold_batches(p.stats_row, batches, p.seqlen, lean.stats_row) &&
         fold_batches(p.out_row, batches, p.seqlen, lean.out_row) &&
         (p.out_stats == nullptr ||
          fold_batches(p.out_stats_row, batches, p.seqlen, lean.out_stats_row));
}

inline bool few_lean_call(const MergeParams& p, int64_t threads, int depth, MergeParams& lean,
                          uint32_t& heads) {
  if (p.num_splits > depth || !few_lean_rows(p, threads, lean, heads)) return false;
  const int64_t tokens = p.rows / heads;
  return row_offsets_fit(lean.o_row, tokens, heads, p.head_dim) &&
         row_offsets_fit(lean.stats_row, tokens, heads, 2) &&
         row_offsets_fit(lean.out_row, tokens, heads, p.head_dim) &&
         (p.out_stats == nullptr || row_offsets_fit(lean.out_stats_row, tokens, heads, 2));
}

// Whether a lean call of depth 2 and one vector a thread takes the pair
// instance (few_lean_merge's kPair): exactly two states a row, and no
// in-place export, whose __syncwarp wants every thread of the warp (the pair
// instance's threads past the rows have left).
inline bool few_pair_call(const MergeParams& lean) {
  return lean.num_splits == 2 && !lean.stats_in_place;
}

// The stride from one row to the next of a tensor whose (token, head) rows
// are evenly spaced (one head a token, or a token stride of `heads` head
// strides), in `row`; false for any other layout.
inline bool even_row_stride(const RowStrides& s, uint32_t heads, int64_t& row) {
  if (heads != 1 && s.token != int64_t{heads} * s.head) return false;
  row = heads == 1 ? s.token : s.head;
  return true;
}

// Whether a lean call (`lean`, `heads`, as few_lean_params made `f`) of
// `lanes` threads a row at one vector a thread takes the packed instance
// (few_lean_merge's kPacked): a power-of-two count of lanes (any count where
// `any_lanes`: the pair's, whose row may be a quotient; f.lanes_log2 is then
// -1), partials' and output's rows each head_dim elements after the last (any
// split stride, any row stride of the stats), and no in-place export (its
// threads past the rows leave first). If so, `f` addresses the rows as one
// head a token.
inline bool few_packed_call(const MergeParams& lean, uint32_t heads, int lanes,
                            FewLeanParams& f, bool any_lanes = false) {
  const int lanes_log2 = exact_log2(lanes);
  int64_t o_row = 0, s_row = 0, out_row = 0, out_stats_row = 0;
  if ((lanes_log2 < 0 && !any_lanes) || lean.stats_in_place ||
      !even_row_stride(lean.o_row, heads, o_row) ||
      !even_row_stride(lean.stats_row, heads, s_row) ||
      !even_row_stride(lean.out_row, heads, out_row) || o_row != lean.head_dim ||
      out_row != lean.head_dim ||
      (lean.out_stats != nullptr && !even_row_stride(lean.out_stats_row, heads, out_stats_row))) {
    return false;
  }
  // Within 32 bits, as every row's offsets are (few_lean_call).
  f.heads = FastDivmod(1);
  f.lanes_log2 = lanes_log2;
  f.o_token = static_cast<int32_t>(o_row);
  f.s_token = static_cast<int32_t>(s_row);
  f.out_token = static_cast<int32_t>(out_row);
  f.out_stats_token = static_cast<int32_t>(out_stats_row);
  f.o_head = f.s_head = f.out_head = f.out_stats_head = 0;
  return true;
}

// The packed block: those parameters of `f` (as few_packed_call made it)
// that the packed pair and the small calls' depth-4 instance read.
inline FewPackedParams few_packed_params(const FewLeanParams& f) {
  return FewPackedParams{f.partial_o,  f.stats,           f.o_split,    f.s_split,
                         f.out,        f.out_stats,       f.rows,       f.lanes_log2,
                         f.s_token,    f.out_stats_token, f.log2_scale, f.empty_stat,
                         f.export_scale, f.num_splits,    f.out_scale};
}

// The same, for rows whose count of threads is not a power of two.
inline FewPackedDivParams few_packed_pair_div_params(const FewLeanParams& f) {
  return FewPackedDivParams{few_packed_params(f), f.lanes};
}

// The order in which the lean kernel's threads take a call's rows: (token,
// head), or (head, token) where that puts adjacent threads' stats side by side
// (a head-major LSE: vLLM's and FlashAttention's [heads, tokens]). Rows are
// independent, so only the memory each warp touches changes: with token-major
// order every row of a head-major LSE sits in its own 32-byte sector, which a
// warp of two or more rows then reads once per row instead of once (vLLM's
// merge exporting its LSE: 5.81 against 5.06 us at 1024 x 32 x 128, 2.29
// against 1.97 at 256 x 32 x 64, benchmarks/lab/lab_order.py, H100). The
// input stats, read once per state, decide; where they do not care, the
// exported ones. Only for partials that fit half the L2 (`l2_bytes`; 0:
// unknown, never): past it the partials stream from DRAM, where head-major
// order costs the loads their locality (4096 x 32 x 128: 36.74 against 35.67
// us) and the scattered stats cost nothing. A row of partials under 32 bytes
// shares its sector with the next row's in a token-major layout: such rows
// keep their order.
inline bool few_lean_head_major(const MergeParams& lean, uint32_t heads, int64_t l2_bytes) {
  const auto far = [](int64_t stride) { return stride < 0 ? -stride : stride; };
  const int64_t tokens = lean.rows / heads;
  const int64_t row_bytes = lean.head_dim * elem_bytes(lean.partial_dtype);
  if (heads < 2 || tokens < 2 || tokens > INT32_MAX || row_bytes < 32 ||
      lean.num_splits * lean.rows * row_bytes > l2_bytes / 2) {
    return false;
  }
  const int64_t token_in = far(lean.stats_row.token), head_in = far(lean.stats_row.head);
  if (token_in != head_in) return token_in < head_in;
  return lean.out_stats != nullptr && far(lean.out_stats_row.token) < far(lean.out_stats_row.head);
}

// `lean` and `heads` with the roles of tokens and heads traded (every tensor's
// row strides and the divisor), for few_lean_head_major's order.
inline void few_lean_transpose(MergeParams& lean, uint32_t& heads) {
  const auto trade = [](RowStrides& s) { std::swap(s.token, s.head); };
  trade(lean.o_row);
  trade(lean.stats_row);
  trade(lean.out_row);
  trade(lean.out_stats_row);
  heads = static_cast<uint32_t>(lean.rows / heads);
}

// The lean kernel's parameters of a call that few_lean_call admitted (`lean`,
// `heads`) on `geo`'s lanes and row.
inline FewLeanParams few_lean_params(const MergeParams& lean, uint32_t heads,
                                     const FewGeometry& geo) {
  const auto i32 = [](int64_t v) { return static_cast<int32_t>(v); };
  FewLeanParams f{};
  f.partial_o = lean.partial_o;
  f.stats = lean.stats;
  f.o_split = lean.o_stride_split;
  f.s_split = lean.stats_stride_split;
  f.lanes = geo.lanes;
  f.heads = FastDivmod(heads);
  f.rows = i32(lean.rows);
  f.num_splits = i32(lean.num_splits);
  f.o_token = i32(lean.o_row.token);
  f.o_head = i32(lean.o_row.head);
  f.s_token = i32(lean.stats_row.token);
  f.s_head = i32(lean.stats_row.head);
  f.log2_scale = lean.log2_scale;
  f.empty_stat = lean.empty_stat;
  f.out = lean.out;
  f.out_token = i32(lean.out_row.token);
  f.out_head = i32(lean.out_row.head);
  f.row_vectors = geo.row_vectors;
  f.lanes_log2 = -1;  // few_packed_call sets it
  f.export_scale = lean.export_scale;
  f.out_stats = lean.out_stats;
  f.out_stats_token = lean.out_stats != nullptr ? i32(lean.out_stats_row.token) : 0;
  f.out_stats_head = lean.out_stats != nullptr ? i32(lean.out_stats_row.head) : 0;
  f.out_scale = lean.out_scale;
  f.stats_in_place = lean.stats_in_place;
  return f;
}

// Launches a checked Few config (check_config, check_call) on rows > 0 (`l2_bytes`: the
// device's L2, for few_lean_head_major).
template <DType kPartial, StatsFormat kFormat>
Status launch_few_typed(const MergeParams& p, const KernelConfig& config, int sm_count, bool pdl,
                        cudaStream_t stream, int64_t l2_bytes = 0) {
  const int general_lanes = few_threads_per_row(p.head_dim, elem_bytes(kPartial), config.vectors);
  if (general_lanes < 1) return fail(Error::kVectors, config.vectors);
  const bool plain = p.flat_rows && p.row_mask == nullptr && p.split_counts == nullptr &&
                     p.indptr == nullptr && p.pass_through_tokens == INT64_MAX &&
                     p.request_starts == nullptr;
  MergeParams lean;
  uint32_t heads = 1;
  const int depth = few_depth(p.num_splits, config.vectors);
  bool is_lean = few_lean_call(p, p.rows * general_lanes, depth, lean, heads);
  // The lean kernel's lanes load few_lean_vector_bytes of a state's row. Where
  // that is under 16, a row has more of them: an in-place export needs a row's
  // lanes in one warp as checked for 16 (check_call_rules), and one pass of the
  // grid must still cover the call; else the general kernel serves it.
  int vector_bytes = kBytesPerThread;
  int lanes = general_lanes;
  if (is_lean && few_lean_vector_bytes(kPartial, p.out_dtype, depth) < kBytesPerThread) {
    const int narrow = few_lean_vector_bytes(kPartial, p.out_dtype, depth);
    const int narrow_lanes = few_threads_per_row(p.head_dim, elem_bytes(kPartial), config.vectors, narrow);
    is_lean = !p.stats_in_place && p.rows * narrow_lanes <= kFewMaxGridThreads;
    if (is_lean) {
      vector_bytes = narrow;
      lanes = narrow_lanes;
    }
  }
  if (is_lean && few_lean_head_major(lean, heads, l2_bytes)) few_lean_transpose(lean, heads);
  const FewLaunch shape = make_few_launch(lanes, p.rows, sm_count);
  // TensorRT-LLM's calls (check_problem, check_call: two LSE splits, depth 2).
  const bool requests = p.request_starts != nullptr || p.pair_stats;
  const FewGeometry geo{FastDivmod(static_cast<uint32_t>(lanes)),
                        p.head_dim * elem_bytes(kPartial) / vector_bytes, shape.rows_per_pass,
                        plain};
  PdlLaunch launch(static_cast<unsigned>(shape.ctas), static_cast<unsigned>(shape.cta_threads), 0,
                   stream, pdl);
  Status status;
  cudaError_t error = cudaSuccess;
  KVSPLIT_DISPATCH_FEW_DEPTH(depth, kDepth, status, {
    KVSPLIT_DISPATCH_FEW_VECTORS(config.vectors, kVectors, status, {
      if constexpr (few_loads_fit(kDepth, kVectors)) {
        if (requests) {
          if constexpr (kFormat == StatsFormat::kLse && kDepth == 2) {
            error = cudaLaunchKernelEx(&launch.config,
                                       few_kernel<kPartial, kFormat, 2, kVectors, true>, geo, p);
          } else {
            status = fail(Error::kSplitRange, p.num_splits);
          }
        } else if (!is_lean) {
          error = cudaLaunchKernelEx(&launch.config,
                                     few_kernel<kPartial, kFormat, kDepth, kVectors>, geo, p);
        } else {
          FewLeanParams f = few_lean_params(lean, heads, geo);
          // Instances at one vector a thread: the pair (exactly two states) and
          // the packed rows' of a pair or of three or four states. (A depth-2 call
          // that is not a pair, one state or an in-place export, takes the general
          // instance.)
          const bool pair = kDepth == 2 && kVectors == 1 && few_pair_call(lean);
          // Decode sizes (few_packed_small_call) take the divided packed pair and
          // the depth-4 instance on the packed block; larger calls the former
          // instances (at 32 MB the divided pair took 1 % longer than the pair on
          // (token, head) strides, H100).
          const bool small = few_packed_small_call(p.rows, lanes, sm_count);
          const bool packed = (pair || (kDepth == 4 && kVectors == 1)) &&
                              few_packed_call(lean, heads, lanes, f, pair && small);
          if (pair && packed && f.lanes_log2 >= 0) {
            const auto kernel = lean_instance(p.out_dtype, [](auto out) {
              return few_packed_pair_kernel<kPartial, kFormat, decltype(out)::value>;
            });
            error = cudaLaunchKernelEx(&launch.config, kernel, few_packed_params(f));
          } else if (pair && packed) {
            const auto kernel = lean_instance(p.out_dtype, [](auto out) {
              return few_packed_pair_div_kernel<kPartial, kFormat, decltype(out)::value>;
            });
            error = cudaLaunchKernelEx(&launch.config, kernel, few_packed_pair_div_params(f));
          } else if (packed && small) {
            const auto kernel = lean_instance(p.out_dtype, [](auto out) {
              return few_packed_quad_kernel<kPartial, kFormat, decltype(out)::value>;
            });
            error = cudaLaunchKernelEx(&launch.config, kernel, few_packed_params(f));
          } else {
            const auto kernel = lean_instance(p.out_dtype, [&](auto out) {
              constexpr DType kOut = decltype(out)::value;
              if constexpr (kVectors == 1 && kDepth == 2) {
                if (pair) return few_lean_kernel<kPartial, kFormat, 2, 1, kOut, true>;
              }
              if constexpr (kVectors == 1 && kDepth == 4) {
                if (packed) return few_lean_kernel<kPartial, kFormat, 4, 1, kOut, false, true>;
              }
              return few_lean_kernel<kPartial, kFormat, kDepth, kVectors, kOut>;
            });
            error = cudaLaunchKernelEx(&launch.config, kernel, f);
          }
        }
      } else {
        status = fail(Error::kVectors, kVectors);
      }
    })
  })
  return error != cudaSuccess ? fail(Error::kCuda, error) : status;
}

}  // namespace kvsplit
