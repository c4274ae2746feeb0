// FP8 quantisation on the GPU (fp8.h): one launch quantises up to kFp8BatchJobs tensors (the jobs ride in
// the kernel's parameters), one thread block per scale block, found by binary search over the jobs' first
// blocks. A block whose rows are 16-byte aligned runs of columns (the sync's case: contiguous weights) is
// read in 16-byte vectors held in registers: its amax (warp shuffles, then shared memory), then its bytes
// from the registers, written 2-8 at a time; the block is read from memory once (a block larger than the
// registers hold, kCache vectors a thread, reads the rest again, from L2). Other layouts (transposed,
// stepped) read element by element, twice. The division by the scale is the work per element: for 16-bit
// sources fp8.h's fp8_divide (the block's reciprocal and one correcting FMA: the same e4m3 bytes as IEEE
// division for every 16-bit pair), else __fdiv_rn (IEEE division whatever the compile flags, as the CPU path
// divides; longer, and a branch). On sm_89+ the e4m3 rounding is the hardware's
// conversion (cvt.rn.satfinite, two values an instruction), elsewhere fp8.h's; both give fp8.h's bytes, but
// for a NaN's sign (the hardware writes one NaN code).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common/check.h"
#include "common/cuda_utils.h"
#include "reshard/fp8.h"

namespace vf::reshard {

namespace {

constexpr int kThreads = 256;
constexpr int kCache = 8;  // 16-byte vectors a thread keeps: a 128 x 128 bf16 block (32 KiB) whole

// The source element types by their bits: float from the raw storage.
template <DType D> struct Src;
template <> struct Src<DType::f32> {
  using raw = uint32_t;
  static __device__ __forceinline__ float to_float(raw u) { return __uint_as_float(u); }
};
template <> struct Src<DType::f64> {
  using raw = unsigned long long;
  static __device__ __forceinline__ float to_float(raw u) { return static_cast<float>(__longlong_as_double(u)); }
};
template <> struct Src<DType::bf16> {
  using raw = uint16_t;
  static __device__ __forceinline__ float to_float(raw u) { return __uint_as_float(static_cast<uint32_t>(u) << 16); }
};
template <> struct Src<DType::f16> {
  using raw = uint16_t;
  static __device__ __forceinline__ float to_float(raw u) { return __half2float(__ushort_as_half(u)); }
};

// V e4m3 bytes stored at once (V = the elements of a 16-byte vector).
template <int V> struct Bytes;
template <> struct Bytes<8> { using type = uint2; };
template <> struct Bytes<4> { using type = uint32_t; };
template <> struct Bytes<2> { using type = uint16_t; };

// A block's divisor: its scale and, where fp8_divide is used (Rcp), the scale's reciprocal.
struct Divisor {
  float scale, inv;
};

template <bool Rcp>
__device__ __forceinline__ float divide(float x, const Divisor& d) {
  if constexpr (Rcp) return fp8_divide(x, d.scale, d.inv);
  else return __fdiv_rn(x, d.scale);
}

// The e4m3 bytes of a / scale and b / scale, a's in the low byte.
template <bool Rcp>
__device__ __forceinline__ uint32_t e4m3_pair(float a, float b, const Divisor& d) {
  const float qa = divide<Rcp>(a, d), qb = divide<Rcp>(b, d);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __nv_cvt_float2_to_fp8x2(make_float2(qa, qb), __NV_SATFINITE, __NV_E4M3);
#else
  return float_to_e4m3(qa) | (static_cast<uint32_t>(float_to_e4m3(qb)) << 8);
#endif
}

template <DType D>
union Vec {
  static constexpr int n = 16 / sizeof(typename Src<D>::raw);
  uint4 bits;
  typename Src<D>::raw e[n];
};

template <DType D>
__device__ __forceinline__ float vec_amax(const Vec<D>& v) {
  float m = 0.0f;
#pragma unroll
  for (int t = 0; t < Vec<D>::n; ++t) m = fmaxf(m, fabsf(Src<D>::to_float(v.e[t])));
  return m;
}

template <DType D, bool Rcp>
__device__ __forceinline__ typename Bytes<Vec<D>::n>::type vec_e4m3(const Vec<D>& v, const Divisor& d) {
  constexpr int n = Vec<D>::n;
  uint32_t w[(n + 3) / 4] = {};
#pragma unroll
  for (int t = 0; t < n; t += 2)
    w[t / 4] |= e4m3_pair<Rcp>(Src<D>::to_float(v.e[t]), Src<D>::to_float(v.e[t + 1]), d) << (8 * (t % 4));
  if constexpr (n == 8) return make_uint2(w[0], w[1]);
  else if constexpr (n == 4) return w[0];
  else return static_cast<uint16_t>(w[0]);
}

// The block's amax, every thread's copy; thread 0 stores the scale.
__device__ __forceinline__ float block_scale(float amax, float* scale_at) {
  __shared__ float warp_max[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    amax = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (threadIdx.x == 0) warp_max[0] = amax;
  }
  __syncthreads();
  const float scale = fp8_scale(warp_max[0]);
  if (threadIdx.x == 0) *scale_at = scale;
  return scale;
}

// Whether a block of this source type divides with fp8_divide (fp8.h: 16-bit sources, a scale in range).
template <DType D>
__device__ __forceinline__ bool use_rcp(float scale) {
  return sizeof(typename Src<D>::raw) == 2 && fp8_reciprocal_ok(scale);
}

// Thread threadIdx.x's vectors of an h x vw block (vw vectors a row): vector threadIdx.x + k * kThreads at
// (r, c) for k = 0, 1, ...; one integer division a thread (a long instruction sequence), then steps.
struct Walk {
  int r, c;
  const int vw, dr, dc;
  __device__ __forceinline__ explicit Walk(int vw_)
      : r(threadIdx.x / vw_), c(threadIdx.x % vw_), vw(vw_), dr(kThreads / vw_), dc(kThreads % vw_) {}
  __device__ __forceinline__ void next() {
    r += dr;
    c += dc;
    if (c >= vw) c -= vw, ++r;
  }
};

// An h x w block of 16-byte aligned rows (w a multiple of the vector's elements): the bytes of each thread's
// first kCache vectors from its registers, of the rest read again.
template <DType D, bool Rcp>
__device__ __forceinline__ void vector_stores(const typename Src<D>::raw* src, int64_t src_rs, uint8_t* dst,
                                              int64_t dst_rs, int h, int vw, const Vec<D> (&cache)[kCache],
                                              const Divisor& d) {
  constexpr int V = Vec<D>::n;
  using Out = typename Bytes<V>::type;
  Walk p(vw);
#pragma unroll
  for (int k = 0; k < kCache; ++k, p.next())
    if (p.r < h) *reinterpret_cast<Out*>(dst + p.r * dst_rs + p.c * V) = vec_e4m3<D, Rcp>(cache[k], d);
  for (; p.r < h; p.next()) {
    Vec<D> v;
    v.bits = __ldg(reinterpret_cast<const uint4*>(src + p.r * src_rs + p.c * V));
    *reinterpret_cast<Out*>(dst + p.r * dst_rs + p.c * V) = vec_e4m3<D, Rcp>(v, d);
  }
}

template <DType D>
__device__ void vector_block(const typename Src<D>::raw* src, int64_t src_rs, uint8_t* dst, int64_t dst_rs,
                             int h, int w, float* scale_at) {
  constexpr int V = Vec<D>::n;
  const int vw = w / V;
  Vec<D> cache[kCache];
  float amax = 0.0f;
  Walk p(vw);
#pragma unroll
  for (int k = 0; k < kCache; ++k, p.next())
    if (p.r < h) {
      cache[k].bits = __ldg(reinterpret_cast<const uint4*>(src + p.r * src_rs + p.c * V));
      amax = fmaxf(amax, vec_amax<D>(cache[k]));
    }
  for (; p.r < h; p.next()) {
    Vec<D> v;
    v.bits = __ldg(reinterpret_cast<const uint4*>(src + p.r * src_rs + p.c * V));
    amax = fmaxf(amax, vec_amax<D>(v));
  }
  const float scale = block_scale(amax, scale_at);
  if (use_rcp<D>(scale))
    vector_stores<D, true>(src, src_rs, dst, dst_rs, h, vw, cache, {scale, __frcp_rn(scale)});
  else
    vector_stores<D, false>(src, src_rs, dst, dst_rs, h, vw, cache, {scale, 0.0f});
}

// An h x w block of any strides, element by element.
template <DType D, bool Rcp>
__device__ void strided_stores(const typename Src<D>::raw* src, int64_t src_rs, int64_t src_cs, uint8_t* dst,
                               int64_t dst_rs, int h, int w, const Divisor& d) {
  for (int i = threadIdx.x; i < h * w; i += kThreads) {
    const int r = i / w, c = i - r * w;
    const float x = Src<D>::to_float(src[r * src_rs + c * src_cs]);
    dst[r * dst_rs + c] = static_cast<uint8_t>(e4m3_pair<Rcp>(x, 0.0f, d) & 0xffu);
  }
}

template <DType D>
__device__ void strided_block(const typename Src<D>::raw* src, int64_t src_rs, int64_t src_cs, uint8_t* dst,
                              int64_t dst_rs, int h, int w, float* scale_at) {
  float amax = 0.0f;
  for (int i = threadIdx.x; i < h * w; i += kThreads) {
    const int r = i / w, c = i - r * w;
    amax = fmaxf(amax, fabsf(Src<D>::to_float(src[r * src_rs + c * src_cs])));
  }
  const float scale = block_scale(amax, scale_at);
  if (use_rcp<D>(scale))
    strided_stores<D, true>(src, src_rs, src_cs, dst, dst_rs, h, w, {scale, __frcp_rn(scale)});
  else
    strided_stores<D, false>(src, src_rs, src_cs, dst, dst_rs, h, w, {scale, 0.0f});
}

// Four thread blocks an SM at once (a cap of 64 registers a thread): the occupancy that keeps the reads in
// flight (docs/rollout.md gives the measured alternatives).
template <DType D>
__global__ void __launch_bounds__(kThreads, 4) fp8_quantize_kernel(const __grid_constant__ Fp8Batch batch) {
  using raw = typename Src<D>::raw;
  constexpr int V = Vec<D>::n;
  const int64_t b = blockIdx.x;
  int lo = 0, hi = batch.count - 1;  // the last job whose first block is <= b
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (batch.first_block[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  const Fp8Job& j = batch.jobs[lo];
  const int64_t local = b - batch.first_block[lo], nbc = (j.cols + j.block_cols - 1) / j.block_cols;
  const int64_t br = local / nbc, bc = local - br * nbc;
  const int64_t r0 = br * j.block_rows, c0 = bc * j.block_cols;
  const int h = static_cast<int>(min(j.rows - r0, j.block_rows)), w = static_cast<int>(min(j.cols - c0, j.block_cols));
  const raw* src = static_cast<const raw*>(j.src) + r0 * j.src_rs + c0 * j.src_cs;
  uint8_t* dst = j.dst + r0 * j.dst_rs + c0;
  float* scale_at = j.scale + br * j.scale_rs + bc * j.scale_cs;
  const bool one_row = j.rows == 1;
  const bool vectors = j.src_cs == 1 && j.block_cols % V == 0 && j.cols % V == 0 &&
                       reinterpret_cast<uintptr_t>(j.src) % 16 == 0 && reinterpret_cast<uintptr_t>(j.dst) % V == 0 &&
                       (one_row || ((j.src_rs * sizeof(raw)) % 16 == 0 && j.dst_rs % V == 0));
  if (vectors) vector_block<D>(src, j.src_rs, dst, j.dst_rs, h, w, scale_at);
  else strided_block<D>(src, j.src_rs, j.src_cs, dst, j.dst_rs, h, w, scale_at);
}

template <DType D>
void launch(const Fp8Batch& batch, int64_t blocks, cudaStream_t stream) {
  fp8_quantize_kernel<D><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(batch);
  VF_CUDA_LAUNCH_CHECK("fp8_quantize_kernel");
}

}  // namespace

void fp8_quantize_cuda(const std::vector<Fp8Job>& jobs, uintptr_t stream, int device) {
  DeviceGuard guard(device);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  for (size_t i = 0; i < jobs.size();) {
    Fp8Batch batch{};
    const int32_t dtype = jobs[i].src_dtype;
    int64_t blocks = 0;
    while (i < jobs.size() && batch.count < kFp8BatchJobs && jobs[i].src_dtype == dtype &&
           (batch.count == 0 || blocks + fp8_blocks(jobs[i]) < (int64_t{1} << 31))) {
      batch.jobs[batch.count] = jobs[i];
      batch.first_block[batch.count++] = blocks;
      blocks += fp8_blocks(jobs[i++]);
    }
    batch.first_block[batch.count] = blocks;
    VF_CHECK(blocks < (int64_t{1} << 31), "too many FP8 scale blocks (", blocks, ") for one launch");
    switch (static_cast<DType>(dtype)) {
      case DType::f32: launch<DType::f32>(batch, blocks, s); break;
      case DType::f64: launch<DType::f64>(batch, blocks, s); break;
      case DType::bf16: launch<DType::bf16>(batch, blocks, s); break;
      case DType::f16: launch<DType::f16>(batch, blocks, s); break;
      default: throw TypeError(cat("unsupported float dtype ", dtype_name(static_cast<DType>(dtype))));
    }
  }
}

}  // namespace vf::reshard
