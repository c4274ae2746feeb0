// CUDA executor of the resharding plan: one launch per phase of a bucket, one thread block per
// tile. The segment and tile tables are uploaded once per plan; the pointer table (sources,
// destinations, staging slots) again only when the bound tensors changed, queued on the stream
// (no host wait). Same-dtype tiles copy
// with the widest vector (16, 8, 4, 2 or 1 bytes) that every address, pitch and width of the tile
// allows; dtype changes go element by element through float.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common/check.h"
#include "common/cuda_utils.h"
#include "reshard/reshard.h"

namespace vf::reshard {

struct CudaTables {
  int device = 0;
  Segment* segs = nullptr;
  Tile* tiles = nullptr;
  void** ptrs = nullptr;
  std::vector<void*> uploaded;  // host copy of the pointer table last uploaded
  cudaStream_t last_stream = nullptr;  // where the last launch went (reads `ptrs` until it finishes)
  bool launched = false;
};

// Runs from destructors (possibly at interpreter exit, after the runtime shut down): never throws,
// ignores errors.
void free_cuda_tables(CudaTables* t) {
  if (t == nullptr) return;
  int prev = -1;
  if (cudaGetDevice(&prev) == cudaSuccess && cudaSetDevice(t->device) == cudaSuccess) {
    cudaFree(t->segs);
    cudaFree(t->tiles);
    cudaFree(t->ptrs);
    cudaSetDevice(prev);
  }
  cudaGetLastError();  // clear a sticky error from the calls above, if any
  delete t;
}

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
// Block b copies part b % parts of tile begin + b / parts, each part about kPartBytes: consecutive
// blocks, which run at the same time, then work on neighbouring addresses, as they would with tiles
// that small (faster than larger tiles; docs/benchmarks.md, "Measurements behind the code's choices"),
// while the plan keeps one table entry per tile_bytes.
constexpr int64_t kPartBytes = 16 << 10;
constexpr int64_t kMaxParts = 64;

template <int V>
struct Vec;
template <> struct Vec<16> { using T = uint4; };
template <> struct Vec<8> { using T = uint2; };
template <> struct Vec<4> { using T = uint32_t; };
template <> struct Vec<2> { using T = uint16_t; };
template <> struct Vec<1> { using T = uint8_t; };

// Where part `part` of `parts` over `total` items begins (part `parts`: where the last one ends).
__device__ __forceinline__ uint32_t part_begin(uint32_t total, uint32_t part, uint32_t parts) {
  return static_cast<uint32_t>(static_cast<uint64_t>(total) * part / parts);
}

// Part `part` of `parts` of rows x (nv vectors of V bytes); src == nullptr writes zeros. Each thread
// keeps kUnroll loads in flight before its stores (memory-level parallelism for a bandwidth-bound copy).
template <int V>
__device__ void copy_rows(const char* __restrict__ src, char* __restrict__ dst, int64_t sp, int64_t dp,
                          uint32_t rows, uint32_t nv, uint32_t part, uint32_t parts) {
  using T = typename Vec<V>::T;
  const uint32_t end = part_begin(rows * nv, part + 1, parts);
  for (uint32_t base = part_begin(rows * nv, part, parts) + threadIdx.x; base < end; base += kThreads * kUnroll) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = base + u * kThreads;
      if (i < end) {
        const uint32_t r = rows == 1 ? 0 : i / nv, c = i - r * nv;
        v[u] = src ? *reinterpret_cast<const T*>(src + r * sp + static_cast<int64_t>(c) * V) : T{};
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = base + u * kThreads;
      if (i < end) {
        const uint32_t r = rows == 1 ? 0 : i / nv, c = i - r * nv;
        *reinterpret_cast<T*>(dst + r * dp + static_cast<int64_t>(c) * V) = v[u];
      }
    }
  }
}

__device__ __forceinline__ float load_f(const char* p, int dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::f32: return *reinterpret_cast<const float*>(p);
    case DType::f64: return static_cast<float>(*reinterpret_cast<const double*>(p));
    case DType::bf16: return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
    case DType::f16: return __half2float(*reinterpret_cast<const __half*>(p));
    default: return 0.0f;
  }
}

__device__ __forceinline__ void store_f(char* p, int dtype, float v) {
  switch (static_cast<DType>(dtype)) {
    case DType::f32: *reinterpret_cast<float*>(p) = v; break;
    case DType::f64: *reinterpret_cast<double*>(p) = v; break;
    case DType::bf16: *reinterpret_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(v); break;
    case DType::f16: *reinterpret_cast<__half*>(p) = __float2half_rn(v); break;
    default: break;
  }
}

__device__ __forceinline__ int64_t esize(int dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::bf16: case DType::f16: return 2;
    default: return 1;
  }
}

__global__ void __launch_bounds__(kThreads)
reshard_tiles_kernel(const Segment* __restrict__ segs, const Tile* __restrict__ tiles, int64_t begin,
                     void* const* __restrict__ ptrs, uint32_t parts) {
  const Tile t = tiles[begin + blockIdx.x / parts];
  const uint32_t part = blockIdx.x % parts;
  const Segment s = segs[t.seg];
  const int64_t dsz = esize(s.dst_dtype), ssz = esize(s.src_dtype);
  char* dst = static_cast<char*>(ptrs[s.dst]) + (s.dst_off + t.row0 * s.dst_pitch + t.col0) * dsz;
  const char* src = s.src < 0 ? nullptr
                              : static_cast<const char*>(ptrs[s.src]) + (s.src_off + t.row0 * s.src_pitch + t.col0) * ssz;
  const uint32_t rows = static_cast<uint32_t>(t.nrows);
  if (src == nullptr || s.src_dtype == s.dst_dtype) {
    const int64_t width = t.ncols * dsz, sp = s.src_pitch * dsz, dp = s.dst_pitch * dsz;
    uint64_t bits = reinterpret_cast<uintptr_t>(dst) | static_cast<uint64_t>(width);
    if (src) bits |= reinterpret_cast<uintptr_t>(src);
    if (rows > 1) bits |= static_cast<uint64_t>(dp) | (src ? static_cast<uint64_t>(sp) : 0);
    if ((bits & 15) == 0) return copy_rows<16>(src, dst, sp, dp, rows, static_cast<uint32_t>(width / 16), part, parts);
    if ((bits & 7) == 0) return copy_rows<8>(src, dst, sp, dp, rows, static_cast<uint32_t>(width / 8), part, parts);
    if ((bits & 3) == 0) return copy_rows<4>(src, dst, sp, dp, rows, static_cast<uint32_t>(width / 4), part, parts);
    if ((bits & 1) == 0) return copy_rows<2>(src, dst, sp, dp, rows, static_cast<uint32_t>(width / 2), part, parts);
    return copy_rows<1>(src, dst, sp, dp, rows, static_cast<uint32_t>(width), part, parts);
  }
  const uint32_t cols = static_cast<uint32_t>(t.ncols), total = rows * cols;
  const uint32_t end = part_begin(total, part + 1, parts);
  for (uint32_t i = part_begin(total, part, parts) + threadIdx.x; i < end; i += kThreads) {
    const uint32_t r = rows == 1 ? 0 : i / cols, c = i - r * cols;
    store_f(dst + (r * s.dst_pitch + c) * dsz, s.dst_dtype, load_f(src + (r * s.src_pitch + c) * ssz, s.src_dtype));
  }
}

template <typename T>
T* upload(const std::vector<T>& v, const char* what) {
  T* d = nullptr;
  if (v.empty()) return d;
  cuda_check(cudaMalloc(&d, v.size() * sizeof(T)), what);
  cuda_check(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), what);
  return d;
}

}  // namespace

void Plan::run_cuda(int64_t begin, int64_t end, const std::vector<void*>& ptrs, uintptr_t stream) {
  DeviceGuard guard(device_index_);
  auto st = reinterpret_cast<cudaStream_t>(stream);
  if (!cuda_ || cuda_->device != device_index_) {
    cuda_.reset(new CudaTables());
    cuda_->device = device_index_;
    cuda_->segs = upload(segments_, "cudaMemcpy (reshard segments)");
    cuda_->tiles = upload(tiles_, "cudaMemcpy (reshard tiles)");
    cuda_check(cudaMalloc(&cuda_->ptrs, ptrs.size() * sizeof(void*)), "cudaMalloc (reshard pointers)");
  }
  if (cuda_->uploaded != ptrs) {
    if (cuda_->uploaded.size() != ptrs.size()) {  // cudaFree waits for the kernels that read the old table
      cudaFree(cuda_->ptrs);
      cuda_check(cudaMalloc(&cuda_->ptrs, ptrs.size() * sizeof(void*)), "cudaMalloc (reshard pointers)");
    }
    // Launches already queued may still read the old table. On this stream the copy is ordered
    // after them; a launch on another stream (the caller switched streams: rare) is waited for
    // first, through the whole device, since that stream may no longer exist.
    if (cuda_->launched && cuda_->last_stream != st)
      cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (reshard pointers)");
    // A small copy from pageable memory: the driver stages `ptrs` before returning, so it may go away.
    cuda_check(cudaMemcpyAsync(cuda_->ptrs, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice, st),
               "cudaMemcpyAsync (reshard pointers)");
    cuda_->uploaded = ptrs;
  }
  const int64_t parts = std::min(kMaxParts, std::max<int64_t>(1, tile_bytes_ / kPartBytes));
  const int64_t n = (end - begin) * parts;
  VF_CHECK(n < (int64_t{1} << 31), "too many tiles in one bucket (", end - begin, "): raise tile_bytes");
  reshard_tiles_kernel<<<static_cast<unsigned>(n), kThreads, 0, st>>>(cuda_->segs, cuda_->tiles, begin, cuda_->ptrs,
                                                                       static_cast<uint32_t>(parts));
  VF_CUDA_LAUNCH_CHECK("reshard_tiles_kernel");
  cuda_->last_stream = st;
  cuda_->launched = true;
}

}  // namespace vf::reshard
