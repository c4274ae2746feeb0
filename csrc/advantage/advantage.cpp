// CPU path of the advantage engine and the launchers' argument checks (shared by both devices).
#include "advantage/advantage.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <cmath>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "common/check.h"
#include "common/dispatch.h"
#include "common/parallel.h"

namespace vf::advantage {
namespace {

void check_bt(const TensorRef& t, const char* name, int64_t B, int64_t T) {
  VF_CHECK(t.dim() == 2 && t.sizes[0] == B && t.sizes[1] == T, name,
           " must be a 2-D tensor of shape [B, T] = ", shape_str({B, T}), ", got ", shape_str(t.sizes));
}

void check_output(const TensorRef& t, const char* name, const TensorRef& like) {
  check_bt(t, name, like.sizes[0], like.sizes[1]);
  check_dtype(t, name, DType::f32);
  check_contiguous(t, name);
  check_same_device(t, name, like, "token_level_rewards");
}

void check_status(const TensorRef& status, const TensorRef& like) {
  VF_CHECK(status.dim() == 1 && status.sizes[0] == kStatusWords, "status must be a 1-D int32 tensor of shape [",
           kStatusWords, "], got ", shape_str(status.sizes));
  check_dtype(status, "status", DType::i32);
  check_contiguous(status, "status");
  check_same_device(status, "status", like, "token_level_rewards");
  VF_CHECK(reinterpret_cast<uintptr_t>(status.data) % 8 == 0, "status must be 8-byte aligned");
}

// Whether the optional host_status field was assigned (a default TensorRef has no data and no dims).
bool has_host_status(const TensorRef& host) { return host.data != nullptr || host.dim() != 0; }

void check_host_status(const TensorRef& host) {
  if (!has_host_status(host)) return;
  VF_CHECK(host.dim() == 1 && host.sizes[0] >= 1, "host_status must be a 1-D int32 CPU tensor of shape [1], got ",
           shape_str(host.sizes));
  check_dtype(host, "host_status", DType::i32);
  VF_CHECK(host.device == Device::cpu, "host_status must be on the CPU");
}

void check_workspace(const TensorRef& workspace, int64_t bytes, const TensorRef& like) {
  VF_CHECK(workspace.dim() == 1 && workspace.sizes[0] >= bytes, "workspace must be a 1-D uint8 tensor of ",
           bytes, " bytes, got ", shape_str(workspace.sizes));
  check_dtype(workspace, "workspace", DType::u8);
  check_contiguous(workspace, "workspace");
  check_same_device(workspace, "workspace", like, "token_level_rewards");
  VF_CHECK(reinterpret_cast<uintptr_t>(workspace.data) % 16 == 0, "workspace must be 16-byte aligned");
}

// token_level_rewards [B, T] (float) and response_mask of the same shape and device.
void check_rewards_and_mask(const TensorRef& r, const TensorRef& mask) {
  VF_CHECK(r.dim() == 2, "token_level_rewards must be a 2-D tensor [B, T], got ", shape_str(r.sizes));
  check_float(r, "token_level_rewards");
  check_bt(mask, "response_mask", r.sizes[0], r.sizes[1]);
  check_mask(mask, "response_mask");
  check_same_device(mask, "response_mask", r, "token_level_rewards");
}

void validate(const ScanArgs& a) {
  const TensorRef& r = a.rewards;
  check_rewards_and_mask(r, a.mask);
  const int64_t B = r.sizes[0], T = r.sizes[1];
  if (a.kind == ScanKind::gae) {
    check_bt(a.values, "values", B, T);
    check_float(a.values, "values");
    check_same_device(a.values, "values", r, "token_level_rewards");
  }
  if (a.kind == ScanKind::remax) {
    VF_CHECK(a.baselines.dim() == 1 && a.baselines.sizes[0] == B,
             "reward_baselines must be a 1-D tensor of shape [B] = [", B, "], got ", shape_str(a.baselines.sizes));
    check_float(a.baselines, "reward_baselines");
    check_same_device(a.baselines, "reward_baselines", r, "token_level_rewards");
  }
  check_output(a.advantages, "advantages", r);
  check_output(a.returns, "returns", r);
  check_status(a.status, r);
  check_host_status(a.host_status);
  // outside [0, 1] the scan grows geometrically (gamma = 1e30: every advantage inf or NaN); the
  // negated form also refuses NaN
  VF_CHECK(a.gamma >= 0.0f && a.gamma <= 1.0f, "gamma must be in [0, 1], got ", a.gamma);
  VF_CHECK(a.lam >= 0.0f && a.lam <= 1.0f, "lam must be in [0, 1], got ", a.lam);
  VF_CHECK(a.num_threads >= 0, "num_threads must be >= 0 (0: all cores), got ", a.num_threads);
}

void validate(const GroupArgs& a) {
  const TensorRef& r = a.rewards;
  check_rewards_and_mask(r, a.mask);
  const int64_t B = r.sizes[0];
  VF_CHECK(a.ids.dim() == 1 && a.ids.sizes[0] == B, "index must have one group id per sample: [B] = [", B,
           "], got ", shape_str(a.ids.sizes));
  check_dtype(a.ids, "index", DType::i64);
  check_contiguous(a.ids, "index");
  VF_CHECK(a.ids.device == Device::cpu, "index (group ids) must be on the CPU at this layer");
  check_output(a.advantages, "advantages", r);
  VF_CHECK(B < (int64_t{1} << 31), "at most 2^31 - 1 samples, got ", B);
  check_workspace(a.workspace, group_workspace_bytes(B), r);
  check_status(a.status, r);
  check_host_status(a.host_status);
  // epsilon > 0 keeps a group of equal scores (std 0) from computing 0 / 0
  VF_CHECK(std::isfinite(a.epsilon) && a.epsilon > 0, "epsilon must be finite and > 0, got ", a.epsilon);
  VF_CHECK(a.num_threads >= 0, "num_threads must be >= 0 (0: all cores), got ", a.num_threads);
}

// K rows of a reverse scan at once: the recurrences are serial along T, so interleaving rows
// gives the core independent chains to overlap. K = 2 is the fastest on a 2-core Xeon: more concurrent
// streams defeat the prefetchers (docs/benchmarks.md, "Measurements behind the code's choices").
// Writes advantages/returns (unwhitened) and each row's moments of what is whitened; returns
// status bits.
template <int K, typename R, typename V, typename M>
int32_t scan_rows(const ScanArgs& a, int64_t b0, Sums& sums) {
  const int64_t T = a.rewards.sizes[1];
  const float g = a.gamma, gl = a.gamma * a.lam;
  const int64_t rs = a.rewards.strides[1], vs = a.kind == ScanKind::gae ? a.values.strides[1] : 0,
                ms = a.mask.strides[1];
  const R* r[K];
  const V* v[K];
  const M* m[K];
  float *adv[K], *ret[K];
  float state[K], next_value[K], base[K];
  Sums mom[K] = {};
  int32_t status = 0;
  for (int k = 0; k < K; ++k) {
    const int64_t b = b0 + k;
    r[k] = a.rewards.ptr<const R>() + b * a.rewards.strides[0];
    v[k] = a.kind == ScanKind::gae ? a.values.ptr<const V>() + b * a.values.strides[0] : nullptr;
    m[k] = a.mask.ptr<const M>() + b * a.mask.strides[0];
    adv[k] = a.advantages.ptr<float>() + b * T;
    ret[k] = a.returns.ptr<float>() + b * T;
    state[k] = next_value[k] = 0.0f;
    base[k] = a.kind == ScanKind::remax ? to_float(a.baselines.ptr<const V>()[b * a.baselines.strides[0]]) : 0.0f;
    if (!std::isfinite(base[k])) status |= kBadValues;
  }
  switch (a.kind) {
    case ScanKind::gae:
      for (int64_t t = T - 1; t >= 0; --t) {
        for (int k = 0; k < K; ++k) {
          const float rt = to_float(r[k][t * rs]), vt = to_float(v[k][t * vs]);
          if (!std::isfinite(rt)) status |= kBadRewards;
          if (!std::isfinite(vt)) status |= kBadValues;
          const float delta = rt + g * next_value[k] - vt;
          const M mt = m[k][t * ms];
          if (!binary(mt)) status |= kBadMask;
          if (nonzero(mt)) {
            next_value[k] = vt;
            state[k] = delta + gl * state[k];
            mom[k].add(state[k]);
          }
          adv[k][t] = state[k];
          ret[k][t] = state[k] + vt;
        }
      }
      break;
    case ScanKind::reinforce_pp:
      for (int64_t t = T - 1; t >= 0; --t) {
        for (int k = 0; k < K; ++k) {
          const float rt = to_float(r[k][t * rs]);
          if (!std::isfinite(rt)) status |= kBadRewards;
          const M mt = m[k][t * ms];
          if (!binary(mt)) status |= kBadMask;
          if (nonzero(mt)) {
            state[k] = rt + g * state[k];
            mom[k].add(state[k]);
            ret[k][t] = adv[k][t] = state[k];
          } else {  // the running return passes through unchanged; nothing is returned here
            ret[k][t] = adv[k][t] = 0.0f;
          }
        }
      }
      break;
    case ScanKind::remax:
      for (int64_t t = T - 1; t >= 0; --t) {
        for (int k = 0; k < K; ++k) {
          const float rt = to_float(r[k][t * rs]);
          if (!std::isfinite(rt)) status |= kBadRewards;
          const M mv = m[k][t * ms];
          if (!binary(mv)) status |= kBadMask;
          const bool mt = nonzero(mv);
          if (mt) state[k] += rt;
          ret[k][t] = state[k];
          adv[k][t] = state[k] - (mt ? base[k] : 0.0f);
        }
      }
      break;
  }
  for (int k = 0; k < K; ++k) sums.merge(mom[k]);
  return status;
}

void scan_cpu(const ScanArgs& a) {
  const int64_t B = a.rewards.sizes[0], T = a.rewards.sizes[1];
  advise_huge_pages(a.advantages.data, a.advantages.numel() * 4);
  advise_huge_pages(a.returns.data, a.returns.numel() * 4);
  std::mutex lock;
  int32_t status = 0;
  Sums total{};
  const DType vdt = a.kind == ScanKind::gae ? a.values.dtype
                    : a.kind == ScanKind::remax ? a.baselines.dtype : a.rewards.dtype;
  VF_DISPATCH_FLOAT(a.rewards.dtype, R, [&] {
    VF_DISPATCH_FLOAT(vdt, V, [&] {
      VF_DISPATCH_MASK(a.mask.dtype, M, [&] {
        parallel_for(B, a.num_threads, min_rows_per_thread(T), [&](int64_t begin, int64_t end) {
          constexpr int K = 2;
          int32_t s = 0;
          Sums sums{};
          int64_t b = begin;
          for (; b + K <= end; b += K) s |= scan_rows<K, R, V, M>(a, b, sums);
          for (; b < end; ++b) s |= scan_rows<1, R, V, M>(a, b, sums);
          std::lock_guard<std::mutex> guard(lock);
          status |= s;
          total.merge(sums);
        });
      });
    });
  });
  const bool whiten = a.whiten && a.kind != ScanKind::remax;
  if (whiten && total.n < 2) status |= kTooFewToWhiten;
  if (whiten && !status) {
    const float mean = static_cast<float>(total.mean()), rstd = static_cast<float>(total.rstd());
    float* adv = a.advantages.ptr<float>();
    if (a.kind == ScanKind::gae) {  // GAE whitens every position, as verl does
      parallel_for(B * T, a.num_threads, kMinElementsPerThread, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) adv[i] = (adv[i] - mean) * rstd;
      });
    } else {  // REINFORCE++ zeroes the positions outside the mask
      VF_DISPATCH_MASK(a.mask.dtype, M, [&] {
        parallel_for(B, a.num_threads, min_rows_per_thread(T), [&](int64_t begin, int64_t end) {
          for (int64_t b = begin; b < end; ++b) {
            for (int64_t t = 0; t < T; ++t) {
              float& x = adv[b * T + t];
              x = nonzero(at2<M>(a.mask, b, t)) ? (x - mean) * rstd : 0.0f;
            }
          }
        });
      });
    }
  }
  a.status.ptr<int32_t>()[0] = status;
  *status_sums(a.status) = total;
}

void group_cpu(const GroupArgs& a) {
  const int64_t B = a.rewards.sizes[0], T = a.rewards.sizes[1];
  auto ws = GroupWorkspace::at(a.workspace.data, B);
  std::atomic<int32_t> status{0};
  VF_DISPATCH_FLOAT(a.rewards.dtype, R, [&] {
    VF_DISPATCH_MASK(a.mask.dtype, M, [&] {
      parallel_for(B, a.num_threads, min_rows_per_thread(T), [&](int64_t begin, int64_t end) {
        int32_t s = 0;
        for (int64_t b = begin; b < end; ++b) {
          double score = 0.0, count = 0.0;
          for (int64_t t = 0; t < T; ++t) {
            const float r = to_float(at2<R>(a.rewards, b, t));
            if (!std::isfinite(r)) s |= kBadRewards;
            score += r;
            const M mt = at2<M>(a.mask, b, t);
            if (!binary(mt)) s |= kBadMask;
            count += nonzero(mt) ? 1.0 : 0.0;
          }
          ws.score[b] = score;
          ws.count[b] = count;
        }
        status.fetch_or(s);
      });
    });
  });
  for (int64_t b = 0; b < B; ++b) {
    const int32_t g = ws.row_group[b];
    ws.adv[b] = group_value(a.kind, ws.score, ws.members, ws.offsets[g], ws.offsets[g + 1], ws.score[b],
                            a.epsilon, a.norm_by_std);
  }
  int32_t s = status.load();
  double mean = 0.0, rstd = 1.0;
  const bool whiten = a.whiten && a.kind == GroupKind::reinforce_pp_baseline;
  Sums total{};
  if (whiten) {
    // Whitening a_b * mask over masked positions: row b contributes count_b copies of a_b.
    for (int64_t b = 0; b < B; ++b) total.merge(Sums{ws.count[b], ws.count[b] * ws.adv[b], ws.count[b] * ws.adv[b] * ws.adv[b]});
    if (total.n < 2) {
      s |= kTooFewToWhiten;
    } else {
      mean = total.mean();
      rstd = total.rstd();
    }
  }
  float* out = a.advantages.ptr<float>();
  VF_DISPATCH_MASK(a.mask.dtype, M, [&] {
    parallel_for(B, a.num_threads, min_rows_per_thread(T), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const float v = static_cast<float>(whiten ? (ws.adv[b] - mean) * rstd : ws.adv[b]);
        for (int64_t t = 0; t < T; ++t) out[b * T + t] = nonzero(at2<M>(a.mask, b, t)) ? v : 0.0f;
      }
    });
  });
  a.status.ptr<int32_t>()[0] = s;
  *status_sums(a.status) = total;
}

// Word 0 of a CPU launch's record into host_status (when given).
void copy_status_to_host(const TensorRef& status, const TensorRef& host) {
  if (has_host_status(host)) host.ptr<int32_t>()[0] = status.ptr<int32_t>()[0];
}

// An empty batch has nothing to report: the status record still has to be written (the
// caller allocates it uninitialised), and host_status with it.
void clear_status(const TensorRef& status, const TensorRef& host, uintptr_t stream) {
  if (status.device == Device::cuda) {
#if defined(VF_WITH_CUDA)
    clear_status_cuda(status, stream);
    return copy_status_to_host_cuda(status, host, stream);
#endif
  }
  (void)stream;
  std::memset(status.data, 0, kStatusWords * sizeof(int32_t));
  copy_status_to_host(status, host);
}

}  // namespace

int64_t group_workspace_bytes(int64_t batch) {
  // The group estimators index samples with int32; below that the byte count cannot wrap.
  VF_CHECK(batch >= 0 && batch < (int64_t{1} << 31), "batch must be in [0, 2^31 - 1], got ", batch);
  return GroupWorkspace::bytes(batch);
}

int64_t build_groups(const int64_t* ids, int64_t batch, int32_t* row_group, int32_t* offsets,
                     int32_t* members) {
  std::unordered_map<int64_t, int32_t> slot;
  slot.reserve(static_cast<size_t>(batch) * 2);
  std::vector<int32_t> sizes;
  for (int64_t b = 0; b < batch; ++b) {
    auto [it, inserted] = slot.try_emplace(ids[b], static_cast<int32_t>(sizes.size()));
    if (inserted) sizes.push_back(0);
    row_group[b] = it->second;
    ++sizes[it->second];
  }
  const int64_t G = static_cast<int64_t>(sizes.size());
  offsets[0] = 0;
  for (int64_t g = 0; g < G; ++g) offsets[g + 1] = offsets[g] + sizes[g];
  std::vector<int32_t> fill(offsets, offsets + G);
  for (int64_t b = 0; b < batch; ++b) members[fill[row_group[b]]++] = static_cast<int32_t>(b);
  return G;
}

void advantage_scan(const ScanArgs& a) {
  validate(a);
  if (a.rewards.numel() == 0) return clear_status(a.status, a.host_status, a.stream);
  if (a.rewards.device == Device::cuda) {
#if defined(VF_WITH_CUDA)
    advantage_scan_cuda(a);
    return copy_status_to_host_cuda(a.status, a.host_status, a.stream);
#else
    throw ValueError("verl_fast._C was built without CUDA; reinstall with a CUDA toolkit to use CUDA tensors");
#endif
  }
  scan_cpu(a);
  copy_status_to_host(a.status, a.host_status);
}

void group_advantage(const GroupArgs& a) {
  validate(a);
  const int64_t B = a.rewards.sizes[0];
  if (a.rewards.numel() == 0) return clear_status(a.status, a.host_status, a.stream);
  if (a.rewards.device == Device::cuda) {
#if defined(VF_WITH_CUDA)
    // Groups are formed on the host (ids live there); the CUDA path uploads them with the call.
    std::vector<int32_t> csr(3 * B + 1);
    build_groups(a.ids.ptr<const int64_t>(), B, csr.data(), csr.data() + B, csr.data() + 2 * B + 1);
    group_advantage_cuda(a, csr.data());
    return copy_status_to_host_cuda(a.status, a.host_status, a.stream);
#else
    throw ValueError("verl_fast._C was built without CUDA; reinstall with a CUDA toolkit to use CUDA tensors");
#endif
  }
  auto ws = GroupWorkspace::at(a.workspace.data, B);
  build_groups(a.ids.ptr<const int64_t>(), B, ws.row_group, ws.offsets, ws.members);
  group_cpu(a);
  copy_status_to_host(a.status, a.host_status);
}

}  // namespace vf::advantage
