// Binding tensors to a plan, and the CPU executor: the plan's tiles split over threads, each tile
// a run of memcpy / memset rows, or an element loop where the dtype changes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "common/check.h"
#include "common/dispatch.h"
#include "common/parallel.h"
#include "reshard/reshard.h"

namespace vf::reshard {
namespace {

// float -> bfloat16, round to nearest even (NaN stays a quiet NaN), as torch does.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// float -> IEEE half, round to nearest even, with subnormals, overflow to inf and NaN.
inline uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 rounds to 0
    const uint32_t exp = abs >> 23, man = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // value = man * 2^(exp-150); half subnormal unit 2^-24
    uint32_t h = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((abs >> 13) - (112u << 10));  // rebias exponent 127 -> 15
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float load_as_float(const char* p, int32_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::f32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::f64: { double v; std::memcpy(&v, p, 8); return static_cast<float>(v); }
    case DType::bf16: { bf16_t v; std::memcpy(&v.bits, p, 2); return to_float(v); }
    case DType::f16: { f16_t v; std::memcpy(&v.bits, p, 2); return to_float(v); }
    default: return 0.0f;  // the planner only converts between float types
  }
}

inline void store_from_float(char* p, int32_t dtype, float v) {
  switch (static_cast<DType>(dtype)) {
    case DType::f32: std::memcpy(p, &v, 4); break;
    case DType::f64: { const double d = v; std::memcpy(p, &d, 8); break; }
    case DType::bf16: { const uint16_t b = float_to_bf16(v); std::memcpy(p, &b, 2); break; }
    case DType::f16: { const uint16_t b = float_to_f16(v); std::memcpy(p, &b, 2); break; }
    default: break;
  }
}

void run_tile(const Segment& s, const Tile& t, void* const* ptrs) {
  const int64_t dsz = elem_size(s.dst_dtype), ssz = elem_size(s.src_dtype);
  char* dst = static_cast<char*>(ptrs[s.dst]) + ((s.dst_off + t.row0 * s.dst_pitch + t.col0) * dsz);
  if (s.src < 0) {
    for (int64_t r = 0; r < t.nrows; ++r) std::memset(dst + r * s.dst_pitch * dsz, 0, t.ncols * dsz);
    return;
  }
  // f64 -> f32 and the half types go through float; f32 -> f64 is exact through float too.
  const char* src = static_cast<const char*>(ptrs[s.src]) + ((s.src_off + t.row0 * s.src_pitch + t.col0) * ssz);
  if (s.src_dtype == s.dst_dtype) {
    for (int64_t r = 0; r < t.nrows; ++r) std::memcpy(dst + r * s.dst_pitch * dsz, src + r * s.src_pitch * ssz, t.ncols * dsz);
    return;
  }
  for (int64_t r = 0; r < t.nrows; ++r) {
    const char* sp = src + r * s.src_pitch * ssz;
    char* dp = dst + r * s.dst_pitch * dsz;
    if (s.src_dtype == static_cast<int32_t>(DType::f32) && s.dst_dtype == static_cast<int32_t>(DType::f64)) {
      for (int64_t c = 0; c < t.ncols; ++c) {
        float v;
        std::memcpy(&v, sp + c * 4, 4);
        const double d = v;
        std::memcpy(dp + c * 8, &d, 8);
      }
      continue;
    }
    for (int64_t c = 0; c < t.ncols; ++c) store_from_float(dp + c * dsz, s.dst_dtype, load_as_float(sp + c * ssz, s.src_dtype));
  }
}

const char* slot_kind(int64_t i, int64_t S, int64_t D) {
  return i < S ? "source" : i < S + D ? "destination" : i < S + D + 2 ? "send buffer" : "receive buffer";
}

void check_side(std::vector<TensorRef>& given, const LocalTensors& want, const char* kind,
                std::vector<TensorRef>& all) {
  for (int64_t i = 0; i < want.size(); ++i) {
    TensorRef& t = given[i];
    VF_CHECK_TYPE(static_cast<int32_t>(t.dtype) == want.dtypes[i], kind, " ", want.names[i], " must be ",
                  dtype_name(static_cast<DType>(want.dtypes[i])), ", got ", dtype_name(t.dtype));
    VF_CHECK(t.numel() == want.numels[i], kind, " ", want.names[i], " must have ", want.numels[i],
             " elements, got shape ", shape_str(t.sizes));
    VF_CHECK(t.is_contiguous(), kind, " ", want.names[i], " must be contiguous");
    all.push_back(std::move(t));
  }
}

}  // namespace

#if !defined(VF_WITH_CUDA)
struct CudaTables {};
void free_cuda_tables(CudaTables* t) { delete t; }
#endif

void run_tiles_cpu(const Segment* segs, const Tile* tiles, int64_t begin, int64_t end, void* const* ptrs,
                   int num_threads) {
  // Below a few tiles per thread the threads cost more than they save.
  parallel_for(end - begin, num_threads, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = begin + b; i < begin + e; ++i) run_tile(segs[tiles[i].seg], tiles[i], ptrs);
  });
}

void Plan::bind(std::vector<TensorRef> sources, std::vector<TensorRef> destinations,
                const std::vector<TensorRef>& send_slots, const std::vector<TensorRef>& recv_slots) {
  const int64_t S = src_.size(), D = dst_.size();
  VF_CHECK(static_cast<int64_t>(sources.size()) == S, "expected ", S, " source tensors on rank ", rank_, ", got ",
           sources.size());
  VF_CHECK(static_cast<int64_t>(destinations.size()) == D, "expected ", D, " destination tensors on rank ", rank_,
           ", got ", destinations.size());
  VF_CHECK(send_slots.size() == 2 && recv_slots.size() == 2, "expected 2 send and 2 receive buffers, got ",
           send_slots.size(), " and ", recv_slots.size());
  std::vector<TensorRef> all;
  all.reserve(S + D + 4);
  check_side(sources, src_, "source", all);
  check_side(destinations, dst_, "destination", all);
  for (int k = 0; k < 4; ++k) {
    const TensorRef& t = k < 2 ? send_slots[k] : recv_slots[k - 2];
    const int64_t need = k < 2 ? max_send_ : max_recv_;
    const char* what = k < 2 ? "send buffer" : "receive buffer";
    check_dtype(t, what, DType::u8);
    VF_CHECK(t.dim() == 1 && t.sizes[0] >= need, what, " must be a 1-D uint8 tensor of at least ", need,
             " bytes, got ", shape_str(t.sizes));
    VF_CHECK(t.is_contiguous(), what, " must be contiguous");
    VF_CHECK(reinterpret_cast<uintptr_t>(t.data) % 16 == 0, what, " must be 16-byte aligned");
    all.push_back(t);
  }
  // One device for everything that holds data (an empty tensor may live anywhere).
  int first = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(all.size()); ++i) {
    if (all[i].numel() == 0) continue;
    if (first < 0) {
      first = static_cast<int>(i);
      continue;
    }
    VF_CHECK(all[i].device == all[first].device && all[i].device_index == all[first].device_index,
             slot_kind(i, S, D), " ", i, " is on a different device than ", slot_kind(first, S, D), " ", first,
             " (all tensors of a plan must share one device)");
  }
  device_ = first >= 0 ? all[first].device : Device::cpu;
  device_index_ = first >= 0 ? all[first].device_index : -1;
  bound_ = std::move(all);
}

void Plan::bind_destinations_in(const TensorRef& buffer, const std::vector<int64_t>& offsets) {
  check_bound("bind_destinations_in");
  const int64_t S = src_.size(), D = dst_.size();
  VF_CHECK(static_cast<int64_t>(offsets.size()) == D, "expected ", D, " destination offsets, got ", offsets.size());
  VF_CHECK(buffer.dim() == 1 && buffer.is_contiguous(), "the destination buffer must be a contiguous 1-D tensor, got ",
           shape_str(buffer.sizes));
  const bool any_data = std::any_of(bound_.begin(), bound_.begin() + S, [](const TensorRef& t) { return t.numel() > 0; });
  VF_CHECK(!any_data || (buffer.device == device_ && buffer.device_index == device_index_),
           "the destination buffer is on another device than the bound sources");
  const int64_t esize = dtype_size(buffer.dtype);
  for (int64_t i = 0; i < D; ++i) {
    VF_CHECK_TYPE(static_cast<int32_t>(buffer.dtype) == dst_.dtypes[i], "destination ", dst_.names[i], " must be ",
                  dtype_name(static_cast<DType>(dst_.dtypes[i])), ", the buffer is ", dtype_name(buffer.dtype));
    VF_CHECK(offsets[i] >= 0 && offsets[i] <= buffer.numel() && dst_.numels[i] <= buffer.numel() - offsets[i],
             "destination ", dst_.names[i], " at element ", offsets[i], " (", dst_.numels[i],
             " elements) lies outside the buffer of ", buffer.numel());
    VF_CHECK((offsets[i] * esize) % 16 == 0, "destination ", dst_.names[i], " must start 16-byte aligned in the buffer");
    TensorRef& t = bound_[S + i];
    t = buffer;
    t.data = static_cast<char*>(buffer.data) + offsets[i] * esize;
    t.sizes = {dst_.numels[i]};
    t.strides = {1};
    t.view_offset = offsets[i] * esize;
  }
  if (!any_data) {
    device_ = buffer.device;
    device_index_ = buffer.device_index;
  }
}

std::string Plan::bound_name(int64_t i) const {
  const int64_t S = src_.size(), D = dst_.size();
  if (i < S) return "source " + src_.names[i];
  if (i < S + D) return "destination " + dst_.names[i - S];
  return cat(slot_kind(i, S, D), " ", (i - S - D) % 2);
}

void Plan::check_bound(const char* what) const {
  VF_CHECK(!bound_.empty(), what, ": bind() the tensors first");
}

std::pair<int64_t, int64_t> Plan::tile_range(const Bucket& bk, Phase phase) const {
  switch (phase) {
    case Phase::pack: return {bk.pack_tiles_begin, bk.pack_tiles_end};
    case Phase::copy_local: return {bk.copy_tiles_begin, bk.copy_received_begin};
    case Phase::copy_received: return {bk.copy_received_begin, bk.copy_tiles_end};
    case Phase::copy: break;
  }
  return {bk.copy_tiles_begin, bk.copy_tiles_end};
}

std::vector<int32_t> Plan::touched(int64_t b, Phase phase) const {
  const Bucket& bk = bucket(b);
  if (phase == Phase::pack) return bk.touched[0];
  if (phase == Phase::copy_local) return bk.touched[1];
  if (phase == Phase::copy_received) return bk.touched[2];
  std::vector<int32_t> both = bk.touched[1];
  both.insert(both.end(), bk.touched[2].begin(), bk.touched[2].end());
  return both;
}

void Plan::run(int64_t b, Phase phase, uintptr_t stream, int num_threads) {
  check_bound("run");
  const auto [begin, end] = tile_range(bucket(b), phase);
  if (begin == end) return;
  std::vector<void*> ptrs(bound_.size());
  for (size_t i = 0; i < bound_.size(); ++i) ptrs[i] = bound_[i].data;
  if (device_ == Device::cpu) {
    // A thread per kMinBytesPerThread written at most: starting a thread costs about as much as
    // copying that much, so a small model's weights copy on fewer threads, or on this one.
    constexpr int64_t kMinBytesPerThread = int64_t{1} << 20;
    const Bucket& bk = bucket(b);
    const int64_t bytes = phase == Phase::pack            ? bk.bytes[0]
                          : phase == Phase::copy_local    ? bk.bytes[1]
                          : phase == Phase::copy_received ? bk.bytes[2]
                                                          : bk.bytes[1] + bk.bytes[2];
    int threads = num_threads > 0 ? num_threads : static_cast<int>(std::thread::hardware_concurrency());
    threads = static_cast<int>(std::clamp<int64_t>(bytes / kMinBytesPerThread, 1, std::max(threads, 1)));
    run_tiles_cpu(segments_.data(), tiles_.data(), begin, end, ptrs.data(), threads);
    return;
  }
#if defined(VF_WITH_CUDA)
  run_cuda(begin, end, ptrs, stream);
#else
  (void)stream;
  throw ValueError("the tensors are on a CUDA device but verl_fast._C was built without CUDA");
#endif
}

}  // namespace vf::reshard
