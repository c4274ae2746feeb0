// CUDA path of the advantage engine.
//
// Reverse scans (scan_kernel): one block per row. The block walks its row from the right in chunks of
// kThreads * kItems positions, each thread owning kItems consecutive ones. Each position's update is an
// affine map of the state arriving from its right (x -> a*x + b), so a thread composes the maps of its
// positions, each warp scans its lanes' composites with shuffles, one barrier shares the warps'
// composites through shared memory, and each thread replays its positions from the state that reaches
// it. GAE runs two such scans per chunk: the "next valid value" (a = 1 - m, b = m*V) and the advantage
// (a = m*gamma*lam + (1 - m), b = m*delta). The next chunk's loads are issued before the current chunk is
// scanned. One pass over the inputs; the whitening statistics are accumulated on the way (block_publish),
// and whitening adds one in-place pass.
// Group estimators: per-row sums (row_sums_kernel), then a_b per row from its group's scores.
#include "advantage/advantage.h"
#include "common/check.h"
#include "common/cuda_utils.h"

#include <algorithm>

namespace vf::advantage {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Consecutive positions per thread. A warp per row at 16 positions needs 166 registers a thread, so
// only 8 warps share an SM and too few instructions issue a cycle to keep DRAM busy. A block per row at
// 4 positions a thread keeps to 64 registers, so four blocks (32 warps) share an SM; at 8 positions (119
// registers, two blocks an SM) occupancy falls again. The three layouts' timings: docs/hotpaths.md.
constexpr int kItems = 4;
constexpr int kChunk = kThreads * kItems;  // positions per block step
constexpr int kBlocksPerSm = 4;             // __launch_bounds__: registers capped at 65536 / (4 * 256)
static_assert(kItems == 4 || kItems % 8 == 0, "load_items reads 4, or a multiple of 8, positions a thread");

struct Affine {
  float a, b;  // x -> a * x + b
};

// left after right: apply `right` first, then `left`.
__device__ __forceinline__ Affine after(Affine left, Affine right) {
  return {left.a * right.a, fmaf(left.a, right.b, left.b)};
}
__device__ __forceinline__ float apply(Affine f, float x) { return fmaf(f.a, x, f.b); }

// Block-wide reverse exclusive scan (thread kThreads - 1 rightmost). `mine` maps the state entering this
// thread's positions from the right to the state leaving them on the left; `chunk_in` is the state entering
// the block's chunk. Returns the state entering this thread's positions; *chunk_out receives the state
// leaving the chunk (same in every thread). `shared` (kWarps maps) must not be written again before every
// thread has passed the next call's barrier: callers alternate two.
__device__ __forceinline__ float block_reverse_scan(Affine mine, float chunk_in, float* chunk_out, Affine* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Affine inc = mine;  // lanes lane..31
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const Affine other{__shfl_down_sync(0xffffffffu, inc.a, o), __shfl_down_sync(0xffffffffu, inc.b, o)};
    if (lane + o < 32) inc = after(inc, other);
  }
  Affine exc{__shfl_down_sync(0xffffffffu, inc.a, 1), __shfl_down_sync(0xffffffffu, inc.b, 1)};
  if (lane == 31) exc = {1.0f, 0.0f};
  if (lane == 0) shared[warp] = inc;  // the warp's whole composite
  __syncthreads();
  float x = chunk_in, warp_in = chunk_in;
#pragma unroll
  for (int w = kWarps - 1; w >= 0; --w) {
    if (w == warp) warp_in = x;
    x = apply(shared[w], x);
  }
  *chunk_out = x;
  return apply(exc, warp_in);
}

// Loads kItems consecutive positions [t, t + kItems) of row b as floats (0 past T). The common
// layouts (unit inner stride, aligned rows) take 16-byte vector loads; anything else reads scalars.
template <int N>
__device__ __forceinline__ void load_items(const View2& v, bool vec_ok, int64_t b, int64_t t, int64_t T, float* out) {
  if (vec_ok && t + N <= T) {
    const char* base = static_cast<const char*>(v.p);
    switch (static_cast<DType>(v.dtype)) {
      case DType::f32: {
        const float4* q = reinterpret_cast<const float4*>(base + (b * v.sb + t) * 4);
#pragma unroll
        for (int k = 0; k < N / 4; ++k) {
          const float4 x = __ldg(q + k);
          out[4 * k] = x.x, out[4 * k + 1] = x.y, out[4 * k + 2] = x.z, out[4 * k + 3] = x.w;
        }
        return;
      }
      case DType::bf16:
      case DType::f16: {  // 8 positions a 16-byte load (4 positions: one 8-byte load)
        constexpr int kWords = N < 8 ? N / 2 : 4;
        const char* q = base + (b * v.sb + t) * 2;
#pragma unroll
        for (int k = 0; k < (N + 7) / 8; ++k) {
          uint32_t w[4];
          if constexpr (kWords == 4) {
            const uint4 x = __ldg(reinterpret_cast<const uint4*>(q) + k);
            w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
          } else {
            const uint2 x = __ldg(reinterpret_cast<const uint2*>(q));
            w[0] = x.x, w[1] = x.y;
          }
#pragma unroll
          for (int h = 0; h < kWords; ++h) {
            const uint16_t lo = w[h] & 0xffffu, hi = w[h] >> 16;
            if (static_cast<DType>(v.dtype) == DType::bf16) {
              out[8 * k + 2 * h] = __uint_as_float(static_cast<uint32_t>(lo) << 16);
              out[8 * k + 2 * h + 1] = __uint_as_float(static_cast<uint32_t>(hi) << 16);
            } else {
              out[8 * k + 2 * h] = __half2float(__ushort_as_half(lo));
              out[8 * k + 2 * h + 1] = __half2float(__ushort_as_half(hi));
            }
          }
        }
        return;
      }
      case DType::u8:
      case DType::boolean: {  // 8 positions an 8-byte load (4 positions: one 4-byte load)
        const char* q = base + (b * v.sb + t);
#pragma unroll
        for (int k = 0; k < (N + 7) / 8; ++k) {
          uint2 x;
          if constexpr (N >= 8) {
            x = __ldg(reinterpret_cast<const uint2*>(q) + k);
          } else {
            x = {__ldg(reinterpret_cast<const unsigned int*>(q)), 0u};
          }
#pragma unroll
          for (int h = 0; h < (N < 8 ? N : 8); ++h)
            out[8 * k + h] = static_cast<float>(((h < 4 ? x.x : x.y) >> (8 * (h & 3))) & 0xffu);
        }
        return;
      }
      default:
        break;
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = t + j < T ? load_float(v, b, t + j) : 0.0f;
}

// Whether rows of `v` can be read with 16-byte vector loads of kItems positions (decided on the host).
bool vector_loadable(const TensorRef& t, int items) {
  if (t.data == nullptr || t.dim() != 2 || t.strides[1] != 1) return false;
  const int64_t esize = dtype_size(t.dtype);
  const int64_t chunk = items * esize;  // bytes a thread reads a step: 16 (f32), 8 (16-bit), 4 (bytes) at 4 items
  const int64_t align = chunk >= 16 ? 16 : chunk;
  if (t.dtype != DType::f32 && t.dtype != DType::bf16 && t.dtype != DType::f16 && t.dtype != DType::u8 &&
      t.dtype != DType::boolean)
    return false;
  return reinterpret_cast<uintptr_t>(t.data) % align == 0 && (t.strides[0] * esize) % align == 0;
}

__device__ __forceinline__ void store_items(float* row, bool vec_ok, int64_t t, int64_t T, const float* x) {
  if (vec_ok && t + kItems <= T) {
    float4* q = reinterpret_cast<float4*>(row + t);
#pragma unroll
    for (int k = 0; k < kItems / 4; ++k) q[k] = make_float4(x[4 * k], x[4 * k + 1], x[4 * k + 2], x[4 * k + 3]);
    return;
  }
#pragma unroll
  for (int j = 0; j < kItems; ++j)
    if (t + j < T) row[t + j] = x[j];
}

// Adds the block's Sums into the batch-wide ones in the status record and ORs in its status bits:
// a warp-shuffle reduction, one through shared memory, then one thread's atomics per block.
__device__ void block_publish(Sums sums, int status, int* record) {
  __shared__ Sums partial[kWarps];
  __shared__ int bits[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sums.merge(Sums{__shfl_down_sync(0xffffffffu, sums.n, o), __shfl_down_sync(0xffffffffu, sums.s, o),
                    __shfl_down_sync(0xffffffffu, sums.s2, o)});
    status |= __shfl_down_sync(0xffffffffu, status, o);
  }
  if (lane == 0) {
    partial[warp] = sums;
    bits[warp] = status;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
      sums.merge(partial[w]);
      status |= bits[w];
    }
    if (status) atomicOr(record, status);
    if (sums.n > 0) {
      auto* total = reinterpret_cast<double*>(record + 2);
      atomicAdd(total, sums.n);
      atomicAdd(total + 1, sums.s);
      atomicAdd(total + 2, sums.s2);
    }
  }
}

struct ScanDev {
  View2 r, v, base, m;
  bool vec_r, vec_v, vec_m, vec_out;
  float* adv;
  float* ret;
  int* status;  // word 0: Status bits; words 2..7: Sums
  int64_t B, T;
  float gamma, gl;
};

struct TileData {
  float r[kItems], v[kItems], m[kItems];
};

template <ScanKind K>
__device__ __forceinline__ void load_tile(const ScanDev& p, int64_t b, int64_t t, TileData& d) {
  load_items<kItems>(p.r, p.vec_r, b, t, p.T, d.r);
  if (K == ScanKind::gae) {
    load_items<kItems>(p.v, p.vec_v, b, t, p.T, d.v);
  } else {
#pragma unroll
    for (int j = 0; j < kItems; ++j) d.v[j] = 0.0f;
  }
  load_items<kItems>(p.m, p.vec_m, b, t, p.T, d.m);
}

// One block per row: the block walks its row from the right in chunks of kThreads * kItems positions,
// each thread owning kItems consecutive ones; the next chunk's loads are issued before the current chunk
// is scanned, so memory stays busy while the shuffles and the barriers run.
template <ScanKind K>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) scan_kernel(ScanDev p) {
  __shared__ Affine shared[2][kWarps];  // alternated between consecutive scans (block_reverse_scan)
  int turn = 0;
  Sums sums{};  // this thread's share of what gets whitened, over all its block's rows
  int status = 0;
  for (int64_t b = blockIdx.x; b < p.B; b += gridDim.x) {
    float carry = 0.0f, carry_nv = 0.0f;
    const float base = K == ScanKind::remax ? load_float(p.base, b, 0) : 0.0f;
    if (K == ScanKind::remax && !isfinite(base)) status |= kBadValues;
    float* adv_row = p.adv + b * p.T;
    float* ret_row = p.ret + b * p.T;
    int64_t chunk = (p.T - 1) / kChunk * kChunk;
    TileData cur, next;
    load_tile<K>(p, b, chunk + threadIdx.x * kItems, cur);
    for (; chunk >= 0; chunk -= kChunk) {
      const int64_t t0 = chunk + threadIdx.x * kItems;
      if (chunk >= kChunk) load_tile<K>(p, b, t0 - kChunk, next);  // prefetch
      bool m[kItems];
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        m[j] = cur.m[j] != 0.0f;  // 0 past T
        if (!binary(cur.m[j])) status |= kBadMask;
        if (!isfinite(cur.r[j])) status |= kBadRewards;
        if (!isfinite(cur.v[j])) status |= kBadValues;
      }
      float out_a[kItems], out_r[kItems];
      if (K == ScanKind::gae) {
        // Scan 1: the value of the next position with mask 1.
        Affine f{1.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < kItems; ++j) f = after(f, m[j] ? Affine{0.0f, cur.v[j]} : Affine{1.0f, 0.0f});
        float x = block_reverse_scan(f, carry_nv, &carry_nv, shared[turn ^= 1]);
        float delta[kItems];
#pragma unroll
        for (int j = kItems - 1; j >= 0; --j) {
          delta[j] = cur.r[j] + p.gamma * x - cur.v[j];
          if (m[j]) x = cur.v[j];
        }
        // Scan 2: the advantage.
        f = {1.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < kItems; ++j) f = after(f, m[j] ? Affine{p.gl, delta[j]} : Affine{1.0f, 0.0f});
        x = block_reverse_scan(f, carry, &carry, shared[turn ^= 1]);
#pragma unroll
        for (int j = kItems - 1; j >= 0; --j) {
          if (m[j]) x = fmaf(p.gl, x, delta[j]);
          out_a[j] = x;
          out_r[j] = x + cur.v[j];
        }
      } else if (K == ScanKind::reinforce_pp) {
        Affine f{1.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < kItems; ++j) f = after(f, m[j] ? Affine{p.gamma, cur.r[j]} : Affine{1.0f, 0.0f});
        float x = block_reverse_scan(f, carry, &carry, shared[turn ^= 1]);
#pragma unroll
        for (int j = kItems - 1; j >= 0; --j) {
          if (m[j]) x = fmaf(p.gamma, x, cur.r[j]);  // G_t; outside the mask it passes through unchanged
          out_r[j] = out_a[j] = m[j] ? x : 0.0f;
        }
      } else {  // remax
        Affine f{1.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < kItems; ++j) f = after(f, Affine{1.0f, m[j] ? cur.r[j] : 0.0f});
        float x = block_reverse_scan(f, carry, &carry, shared[turn ^= 1]);
#pragma unroll
        for (int j = kItems - 1; j >= 0; --j) {
          if (m[j]) x += cur.r[j];
          out_r[j] = x;
          out_a[j] = x - (m[j] ? base : 0.0f);
        }
      }
      store_items(adv_row, p.vec_out, t0, p.T, out_a);
      store_items(ret_row, p.vec_out, t0, p.T, out_r);
      if (K != ScanKind::remax) {  // float over a thread's kItems positions, double across chunks
        float n = 0.0f, s = 0.0f, s2 = 0.0f;
#pragma unroll
        for (int j = 0; j < kItems; ++j)
          if (m[j]) n += 1.0f, s += out_a[j], s2 = fmaf(out_a[j], out_a[j], s2);
        sums.merge(Sums{n, s, s2});
      }
      cur = next;
    }
  }
  block_publish(sums, status, p.status);
}

// Mean and rstd from the batch-wide Sums in the status record. With fewer than 2 positions to
// whiten (or bad inputs) it flags the record once and the caller leaves the data alone.
__device__ bool whitening(int* record, float* mean, float* rstd) {
  const Sums t = *reinterpret_cast<const Sums*>(record + 2);
  if (t.n < 2.0) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(record, kTooFewToWhiten);
    return false;
  }
  *mean = static_cast<float>(t.mean());
  *rstd = static_cast<float>(t.rstd());
  return true;
}

// GAE: adv <- (adv - mean) * rstd at every position, over the contiguous [B, T] output.
__global__ void __launch_bounds__(kThreads) whiten_all_kernel(float* adv, int64_t n, int* record) {
  float mean, rstd;
  if (!whitening(record, &mean, &rstd)) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  float4* v = reinterpret_cast<float4*>(adv);  // the output is allocated 16-byte aligned
  for (int64_t i = first; i < n / 4; i += stride) {
    float4 x = v[i];
    x.x = (x.x - mean) * rstd, x.y = (x.y - mean) * rstd, x.z = (x.z - mean) * rstd, x.w = (x.w - mean) * rstd;
    v[i] = x;
  }
  for (int64_t i = n / 4 * 4 + first; i < n; i += stride) adv[i] = (adv[i] - mean) * rstd;
}

// REINFORCE++: adv <- (adv - mean) * rstd where the mask is set, 0 elsewhere.
__global__ void __launch_bounds__(kThreads) whiten_masked_kernel(float* adv, View2 mask, int64_t B, int64_t T,
                                                                 int* record) {
  float mean, rstd;
  if (!whitening(record, &mean, &rstd)) return;
  for (int64_t b = blockIdx.x; b < B; b += gridDim.x) {
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
      float& x = adv[b * T + j];
      x = load_float(mask, b, j) != 0.0f ? (x - mean) * rstd : 0.0f;
    }
  }
}

// Group estimators: per-row score and mask count.
__global__ void __launch_bounds__(kThreads) row_sums_kernel(View2 r, View2 m, int64_t B, int64_t T,
                                                            double* score, double* count, int* status) {
  __shared__ double part[2][kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t b = blockIdx.x; b < B; b += gridDim.x) {
    double s = 0.0, c = 0.0;
    int bad = 0;
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
      const float x = load_float(r, b, t);
      if (!isfinite(x)) bad |= kBadRewards;
      s += x;
      const float mt = load_float(m, b, t);
      if (!binary(mt)) bad |= kBadMask;
      c += mt != 0.0f ? 1.0 : 0.0;
    }
    if (bad) atomicOr(status, bad);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s += __shfl_down_sync(0xffffffffu, s, o);
      c += __shfl_down_sync(0xffffffffu, c, o);
    }
    if (lane == 0) {
      part[0][warp] = s;
      part[1][warp] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w) {
        s += part[0][w];
        c += part[1][w];
      }
      score[b] = s;
      count[b] = c;
    }
    __syncthreads();
  }
}

// a_b per row from its group's scores; for whitening, the count-weighted Sums of a_b (row b
// contributes count_b copies) go into the status record.
__global__ void __launch_bounds__(kThreads) group_value_kernel(GroupKind kind, GroupWorkspace ws, int64_t B,
                                                               float epsilon, bool norm_by_std, bool whiten,
                                                               int* record) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  Sums sums{};
  if (b < B) {
    const int32_t g = ws.row_group[b];
    const double a = group_value(kind, ws.score, ws.members, ws.offsets[g], ws.offsets[g + 1], ws.score[b],
                                 epsilon, norm_by_std);
    ws.adv[b] = a;
    const double c = ws.count[b];
    sums = Sums{c, c * a, c * a * a};
  }
  if (whiten) block_publish(sums, 0, record);
}

__global__ void __launch_bounds__(kThreads) broadcast_kernel(GroupWorkspace ws, View2 m, float* out, int64_t B,
                                                             int64_t T, bool whiten, int* record) {
  float mean = 0.0f, rstd = 1.0f;
  if (whiten && !whitening(record, &mean, &rstd)) mean = 0.0f, rstd = 1.0f;
  for (int64_t b = blockIdx.x; b < B; b += gridDim.x) {
    const float a = (static_cast<float>(ws.adv[b]) - mean) * rstd;
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x) out[b * T + t] = load_float(m, b, t) != 0.0f ? a : 0.0f;
  }
}

unsigned grid_for(int64_t rows) { return static_cast<unsigned>(rows < (1 << 30) ? rows : (1 << 30)); }

}  // namespace

void clear_status_cuda(const TensorRef& status, uintptr_t stream) {
  DeviceGuard guard(status.device_index);
  cuda_check(cudaMemsetAsync(status.data, 0, kStatusWords * sizeof(int), reinterpret_cast<cudaStream_t>(stream)),
             "cudaMemsetAsync (status)");
}

void copy_status_to_host_cuda(const TensorRef& status, const TensorRef& host, uintptr_t stream) {
  if (host.data == nullptr) return;  // not asked for (the launchers checked its shape)
  DeviceGuard guard(status.device_index);
  cuda_check(cudaMemcpyAsync(host.data, status.data, sizeof(int32_t), cudaMemcpyDeviceToHost,
                             reinterpret_cast<cudaStream_t>(stream)),
             "cudaMemcpyAsync (status word to the host)");
}

void advantage_scan_cuda(const ScanArgs& a) {
  DeviceGuard guard(a.rewards.device_index);
  auto stream = reinterpret_cast<cudaStream_t>(a.stream.handle);
  const int64_t B = a.rewards.sizes[0], T = a.rewards.sizes[1];
  int* status = a.status.ptr<int>();
  cuda_check(cudaMemsetAsync(status, 0, kStatusWords * sizeof(int), stream), "cudaMemsetAsync (status)");
  const bool gae = a.kind == ScanKind::gae, remax = a.kind == ScanKind::remax;
  float* adv = a.advantages.ptr<float>();
  float* ret = a.returns.ptr<float>();
  const bool vec_out = T % 4 == 0 && reinterpret_cast<uintptr_t>(adv) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(ret) % 16 == 0;
  ScanDev p{View2::of(a.rewards),
            gae ? View2::of(a.values) : View2{nullptr, 0, 0, 0},
            remax ? View2::of(a.baselines) : View2{nullptr, 0, 0, 0},
            View2::of(a.mask),
            vector_loadable(a.rewards, kItems),
            gae && vector_loadable(a.values, kItems),
            vector_loadable(a.mask, kItems),
            vec_out,
            adv,
            ret,
            status,
            B,
            T,
            a.gamma,
            a.gamma * a.lam};
  const unsigned grid = grid_for(B);
  switch (a.kind) {
    case ScanKind::gae: scan_kernel<ScanKind::gae><<<grid, kThreads, 0, stream>>>(p); break;
    case ScanKind::reinforce_pp: scan_kernel<ScanKind::reinforce_pp><<<grid, kThreads, 0, stream>>>(p); break;
    case ScanKind::remax: scan_kernel<ScanKind::remax><<<grid, kThreads, 0, stream>>>(p); break;
  }
  VF_CUDA_LAUNCH_CHECK("advantage scan_kernel");
  if (a.whiten && !remax) {
    if (gae) {
      const int64_t n = B * T;
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n / 4 + kThreads - 1) / kThreads + 1, 4096));
      whiten_all_kernel<<<blocks, kThreads, 0, stream>>>(adv, n, status);
      VF_CUDA_LAUNCH_CHECK("advantage whiten_all_kernel");
    } else {
      whiten_masked_kernel<<<grid_for(B), kThreads, 0, stream>>>(adv, p.m, B, T, status);
      VF_CUDA_LAUNCH_CHECK("advantage whiten_masked_kernel");
    }
  }
}

void group_advantage_cuda(const GroupArgs& a, const int32_t* host_csr) {
  DeviceGuard guard(a.rewards.device_index);
  auto stream = reinterpret_cast<cudaStream_t>(a.stream.handle);
  const int64_t B = a.rewards.sizes[0], T = a.rewards.sizes[1];
  auto ws = GroupWorkspace::at(a.workspace.data, B);
  cuda_check(cudaMemcpyAsync(ws.row_group, host_csr, (3 * B + 1) * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync (group ids to the device)");
  const View2 r = View2::of(a.rewards), m = View2::of(a.mask);
  int* status = a.status.ptr<int>();
  cuda_check(cudaMemsetAsync(status, 0, kStatusWords * sizeof(int), stream), "cudaMemsetAsync (status)");
  const unsigned grid = grid_for(B);
  row_sums_kernel<<<grid, kThreads, 0, stream>>>(r, m, B, T, ws.score, ws.count, status);
  VF_CUDA_LAUNCH_CHECK("advantage row_sums_kernel");
  const bool whiten = a.whiten && a.kind == GroupKind::reinforce_pp_baseline;
  group_value_kernel<<<static_cast<unsigned>((B + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      a.kind, ws, B, a.epsilon, a.norm_by_std, whiten, status);
  VF_CUDA_LAUNCH_CHECK("advantage group_value_kernel");
  broadcast_kernel<<<grid, kThreads, 0, stream>>>(ws, m, a.advantages.ptr<float>(), B, T, whiten, status);
  VF_CUDA_LAUNCH_CHECK("advantage broadcast_kernel");
}

}  // namespace vf::advantage
