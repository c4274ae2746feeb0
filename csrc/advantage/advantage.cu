// CUDA path of the advantage engine.
//
// Reverse scans: one block per row; the row is cut into tiles of kThreads * kItems positions walked
// from the right. Each position's update is an affine map of the state arriving from its right
// (x -> a*x + b), so a thread composes the maps of its kItems consecutive positions, the block scans
// the threads' composites (warp shuffles, then the warps' totals), and each thread replays its
// positions from the state that reaches it. GAE runs two such scans per tile: the "next valid value"
// (a = 1 - m, b = m*V) and then the advantage (a = m*gamma*lam + (1 - m), b = m*delta). One pass over
// the inputs, no per-timestep launches; whitening adds a one-block reduction and an in-place pass.
#include "advantage/advantage.h"
#include "common/check.h"
#include "common/cuda_utils.h"

namespace vf::advantage {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 8;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = kThreads * kItems;

struct Affine {
  float a, b;  // x -> a * x + b
};

// left after right: apply `right` first, then `left`.
__device__ __forceinline__ Affine after(Affine left, Affine right) {
  return {left.a * right.a, fmaf(left.a, right.b, left.b)};
}
__device__ __forceinline__ float apply(Affine f, float x) { return fmaf(f.a, x, f.b); }

// Block-wide reverse exclusive scan. `chunk` maps the state entering this thread's positions from
// the right to the state leaving them on the left. Returns the state entering this thread's chunk;
// *tile_out receives the state leaving the whole tile (same in every thread).
__device__ float block_reverse_scan(Affine chunk, float tile_in, float* tile_out) {
  __shared__ Affine warp_total[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Affine inc = chunk;  // lanes lane..31 of this warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const Affine other{__shfl_down_sync(0xffffffffu, inc.a, o), __shfl_down_sync(0xffffffffu, inc.b, o)};
    if (lane + o < 32) inc = after(inc, other);
  }
  Affine exc{__shfl_down_sync(0xffffffffu, inc.a, 1), __shfl_down_sync(0xffffffffu, inc.b, 1)};
  if (lane == 31) exc = {1.0f, 0.0f};
  if (lane == 0) warp_total[warp] = inc;
  __syncthreads();
  float x = tile_in;  // state entering warp `w` from the right, walking w down
  float mine = 0.0f;
#pragma unroll
  for (int w = kWarps - 1; w >= 0; --w) {
    if (w == warp) mine = apply(exc, x);
    x = apply(warp_total[w], x);
  }
  *tile_out = x;
  __syncthreads();  // warp_total is reused by the next call
  return mine;
}

__device__ void block_merge(Moments& m) {
  __shared__ Moments partial[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const Moments other{__shfl_down_sync(0xffffffffu, m.count, o), __shfl_down_sync(0xffffffffu, m.mean, o),
                        __shfl_down_sync(0xffffffffu, m.m2, o)};
    m.merge(other);
  }
  if (lane == 0) partial[warp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) m.merge(partial[w]);
  }
  __syncthreads();
}

struct ScanDev {
  View2 r, v, base, m;
  float* adv;
  float* ret;
  Moments* rows;
  int* status;
  int64_t B, T;
  float gamma, gl;
};

template <ScanKind K>
__global__ void __launch_bounds__(kThreads) scan_kernel(ScanDev p) {
  for (int64_t b = blockIdx.x; b < p.B; b += gridDim.x) {
    float carry = 0.0f, carry_nv = 0.0f;
    Moments mom{};
    int status = 0;
    const float base = K == ScanKind::remax ? load_float(p.base, b, 0) : 0.0f;
    if (K == ScanKind::remax && !isfinite(base)) status |= kBadValues;
    for (int64_t tile = (p.T - 1) / kTile * kTile; tile >= 0; tile -= kTile) {
      const int64_t t0 = tile + static_cast<int64_t>(threadIdx.x) * kItems;
      float r[kItems], v[kItems];
      bool m[kItems], in[kItems];
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int64_t t = t0 + j;
        in[j] = t < p.T;
        r[j] = in[j] ? load_float(p.r, b, t) : 0.0f;
        v[j] = (K == ScanKind::gae && in[j]) ? load_float(p.v, b, t) : 0.0f;
        m[j] = in[j] && load_float(p.m, b, t) != 0.0f;
        if (!isfinite(r[j])) status |= kBadRewards;
        if (!isfinite(v[j])) status |= kBadValues;
      }
      float next[kItems];  // state arriving at each position from its right
      if (K == ScanKind::gae) {
        // Scan 1: value of the next position with mask 1.
        Affine f{1.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < kItems; ++j) f = after(f, m[j] ? Affine{0.0f, v[j]} : Affine{1.0f, 0.0f});
        float x = block_reverse_scan(f, carry_nv, &carry_nv);
        float delta[kItems];
#pragma unroll
        for (int j = kItems - 1; j >= 0; --j) {
          delta[j] = r[j] + p.gamma * x - v[j];
          if (m[j]) x = v[j];
        }
        // Scan 2: the advantage.
        f = {1.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < kItems; ++j) f = after(f, m[j] ? Affine{p.gl, delta[j]} : Affine{1.0f, 0.0f});
        x = block_reverse_scan(f, carry, &carry);
#pragma unroll
        for (int j = kItems - 1; j >= 0; --j) {
          if (m[j]) x = fmaf(p.gl, x, delta[j]);
          next[j] = x;  // A_t
        }
      } else if (K == ScanKind::reinforce_pp) {
        Affine f{1.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < kItems; ++j) f = after(f, m[j] ? Affine{p.gamma, r[j]} : Affine{0.0f, 0.0f});
        float x = block_reverse_scan(f, carry, &carry);
#pragma unroll
        for (int j = kItems - 1; j >= 0; --j) {
          next[j] = fmaf(p.gamma, x, r[j]);  // G_t (returns)
          x = m[j] ? next[j] : 0.0f;
        }
      } else {  // remax
        Affine f{1.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < kItems; ++j) f = after(f, Affine{1.0f, m[j] ? r[j] : 0.0f});
        float x = block_reverse_scan(f, carry, &carry);
#pragma unroll
        for (int j = kItems - 1; j >= 0; --j) {
          if (m[j]) x += r[j];
          next[j] = x;
        }
      }
      // Outputs and this chunk's moments of what gets whitened (masked positions only).
      float cnt = 0.0f, sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        if (!in[j]) continue;
        const int64_t i = b * p.T + t0 + j;
        if (K == ScanKind::gae) {
          p.adv[i] = next[j];
          p.ret[i] = next[j] + v[j];
        } else if (K == ScanKind::reinforce_pp) {
          p.ret[i] = next[j];
          p.adv[i] = m[j] ? next[j] : 0.0f;
        } else {
          p.ret[i] = next[j];
          p.adv[i] = next[j] - (m[j] ? base : 0.0f);
        }
        if (m[j]) {
          cnt += 1.0f;
          sum += next[j];
        }
      }
      if (K != ScanKind::remax && cnt > 0.0f) {
        const float mean = sum / cnt;
        float m2 = 0.0f;
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          const float d = next[j] - mean;
          if (m[j]) m2 = fmaf(d, d, m2);
        }
        mom.merge(Moments{cnt, mean, m2});
      }
    }
    if (status) atomicOr(p.status, status);
    if (K != ScanKind::remax) {
      block_merge(mom);
      if (threadIdx.x == 0) p.rows[b] = mom;
    }
  }
}

// One block: merges the rows' moments into *total; flags too few positions to whiten.
__global__ void __launch_bounds__(kThreads) merge_rows_kernel(const Moments* rows, int64_t B, Moments* total,
                                                              int* status) {
  Moments m{};
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) m.merge(rows[b]);
  block_merge(m);
  if (threadIdx.x == 0) {
    *total = m;
    if (m.count < 2) atomicOr(status, kTooFewToWhiten);
  }
}

// adv <- (adv - mean) * rstd in place, zeroing positions outside the mask when asked.
__global__ void __launch_bounds__(kThreads) whiten_kernel(float* adv, View2 mask, int64_t B, int64_t T,
                                                          const Moments* total, bool zero_unmasked) {
  const Moments t = *total;
  if (t.count < 2) return;
  const float mean = static_cast<float>(t.mean), rstd = static_cast<float>(t.rstd());
  for (int64_t b = blockIdx.x; b < B; b += gridDim.x) {
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
      float& x = adv[b * T + j];
      x = (zero_unmasked && load_float(mask, b, j) == 0.0f) ? 0.0f : (x - mean) * rstd;
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
      if (!isfinite(x)) bad = kBadRewards;
      s += x;
      c += load_float(m, b, t) != 0.0f ? 1.0 : 0.0;
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

__global__ void group_value_kernel(GroupKind kind, GroupWorkspace ws, int64_t B, float epsilon, bool norm_by_std) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b >= B) return;
  const int32_t g = ws.row_group[b];
  ws.adv[b] = group_value(kind, ws.score, ws.members, ws.offsets[g], ws.offsets[g + 1], ws.score[b], epsilon,
                          norm_by_std);
}

// One block: count-weighted moments of a_b (each row contributes count_b copies).
__global__ void __launch_bounds__(kThreads) group_moments_kernel(GroupWorkspace ws, int64_t B, int* status) {
  Moments m{};
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) {
    if (ws.count[b] > 0) m.merge(Moments{ws.count[b], ws.adv[b], 0.0});
  }
  block_merge(m);
  if (threadIdx.x == 0) {
    *ws.total = m;
    if (m.count < 2) atomicOr(status, kTooFewToWhiten);
  }
}

__global__ void __launch_bounds__(kThreads) broadcast_kernel(GroupWorkspace ws, View2 m, float* out, int64_t B,
                                                             int64_t T, bool whiten) {
  float mean = 0.0f, rstd = 1.0f;
  if (whiten) {
    const Moments t = *ws.total;
    if (t.count >= 2) {
      mean = static_cast<float>(t.mean);
      rstd = static_cast<float>(t.rstd());
    }
  }
  for (int64_t b = blockIdx.x; b < B; b += gridDim.x) {
    const float a = (static_cast<float>(ws.adv[b]) - mean) * rstd;
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x) out[b * T + t] = load_float(m, b, t) != 0.0f ? a : 0.0f;
  }
}

unsigned grid_for(int64_t rows) { return static_cast<unsigned>(rows < (1 << 30) ? rows : (1 << 30)); }

}  // namespace

void advantage_scan_cuda(const ScanArgs& a) {
  DeviceGuard guard(a.rewards.device_index);
  auto stream = reinterpret_cast<cudaStream_t>(a.stream);
  const int64_t B = a.rewards.sizes[0], T = a.rewards.sizes[1];
  auto ws = ScanWorkspace::at(a.workspace.data, B);
  ScanDev p{View2::of(a.rewards),
            a.kind == ScanKind::gae ? View2::of(a.values) : View2{nullptr, 0, 0, 0},
            a.kind == ScanKind::remax ? View2::of(a.baselines) : View2{nullptr, 0, 0, 0},
            View2::of(a.mask),
            a.advantages.ptr<float>(),
            a.returns.ptr<float>(),
            ws.rows,
            a.status.ptr<int>(),
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
  if (a.whiten && a.kind != ScanKind::remax) {
    merge_rows_kernel<<<1, kThreads, 0, stream>>>(ws.rows, B, ws.total, p.status);
    VF_CUDA_LAUNCH_CHECK("advantage merge_rows_kernel");
    whiten_kernel<<<grid, kThreads, 0, stream>>>(p.adv, p.m, B, T, ws.total, a.kind == ScanKind::reinforce_pp);
    VF_CUDA_LAUNCH_CHECK("advantage whiten_kernel");
  }
}

void group_advantage_cuda(const GroupArgs& a, const int32_t* host_csr) {
  DeviceGuard guard(a.rewards.device_index);
  auto stream = reinterpret_cast<cudaStream_t>(a.stream);
  const int64_t B = a.rewards.sizes[0], T = a.rewards.sizes[1];
  auto ws = GroupWorkspace::at(a.workspace.data, B);
  cuda_check(cudaMemcpyAsync(ws.row_group, host_csr, (3 * B + 1) * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync (group ids to the device)");
  const View2 r = View2::of(a.rewards), m = View2::of(a.mask);
  int* status = a.status.ptr<int>();
  const unsigned grid = grid_for(B);
  row_sums_kernel<<<grid, kThreads, 0, stream>>>(r, m, B, T, ws.score, ws.count, status);
  VF_CUDA_LAUNCH_CHECK("advantage row_sums_kernel");
  group_value_kernel<<<static_cast<unsigned>((B + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      a.kind, ws, B, a.epsilon, a.norm_by_std);
  VF_CUDA_LAUNCH_CHECK("advantage group_value_kernel");
  const bool whiten = a.whiten && a.kind == GroupKind::reinforce_pp_baseline;
  if (whiten) {
    group_moments_kernel<<<1, kThreads, 0, stream>>>(ws, B, status);
    VF_CUDA_LAUNCH_CHECK("advantage group_moments_kernel");
  }
  broadcast_kernel<<<grid, kThreads, 0, stream>>>(ws, m, a.advantages.ptr<float>(), B, T, whiten);
  VF_CUDA_LAUNCH_CHECK("advantage broadcast_kernel");
}

}  // namespace vf::advantage
