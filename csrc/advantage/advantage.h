// The advantage engine: reverse scans (GAE, REINFORCE++, ReMax) and group-baseline estimators
// (GRPO / Dr.GRPO, RLOO, REINFORCE++-baseline). Semantics follow verl's core_algos.
//
// Layers: this header holds the argument records and the per-element math shared by the CPU
// (advantage.cpp) and CUDA (advantage.cu) paths; the launchers validate every argument, then run
// on the device the tensors live on.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/tensor.h"

#if defined(__CUDACC__)
#define VF_HD __host__ __device__ __forceinline__
#else
#define VF_HD inline
#endif

namespace vf::advantage {

// The call's status record, written by the launchers into an int32 [kStatusWords] tensor:
// word 0 holds Status bits, words 2..7 the batch-wide Sums of what was whitened.
// Python reads these bits and the record's size from _C (AdvantageStatus, status_words).
// host_status (optional, an int32 [1] CPU tensor): the launch also copies word 0 there, on CUDA as
// an asynchronous copy queued after the kernels (pinned memory: the host never waits for it; it
// reads the word once the copy has landed, see verl_fast/ops/_pending.py).
enum Status : int32_t {
  kBadRewards = 1,       // non-finite reward
  kBadValues = 2,        // non-finite value or baseline
  kTooFewToWhiten = 4,   // whitening needs >= 2 positions where the mask is set
  kBadMask = 8,          // a mask value other than 0 and 1
};

// A mask value is 0 or 1 (any other value: kBadMask).
template <typename T>
VF_HD bool binary(T x) {
  return x == T(0) || x == T(1);
}
constexpr int kStatusWords = 8;

// Count, sum and sum of squares, in double: merging is addition (no division on the hot path),
// and double keeps s2 - s*mean exact enough for any advantage scale an RL batch produces.
// An aggregate (no member initialisers) so CUDA can keep it in shared memory: `Sums x{}` is empty.
struct Sums {
  double n, s, s2;
  VF_HD void add(double x) {
    n += 1.0;
    s += x;
    s2 += x * x;
  }
  VF_HD void merge(const Sums& o) {
    n += o.n;
    s += o.s;
    s2 += o.s2;
  }
  VF_HD double mean() const { return s / n; }
  // rsqrt(unbiased variance + 1e-8), as verl's masked_whiten. Needs n >= 2.
  VF_HD double rstd() const {
    const double var = (s2 - s * mean()) / (n - 1.0);
    return 1.0 / sqrt((var > 0.0 ? var : 0.0) + 1e-8);
  }
};

inline Sums* status_sums(const TensorRef& status) { return reinterpret_cast<Sums*>(status.ptr<int32_t>() + 2); }

enum class ScanKind : int { gae = 0, reinforce_pp = 1, remax = 2 };

// Reverse scans along T, one row at a time.
//   gae:          delta_t = r_t + gamma*V_next - V_t; A_t = delta_t + gamma*lam*A_{t+1}; positions with
//                 mask 0 carry V_next and A through unchanged. returns = A + V; advantages = A, whitened
//                 over masked positions (at every position) when `whiten`.
//   reinforce_pp: G_t = r_t + gamma*G_{t+1} where the mask is set; positions with mask 0 (observation
//                 spans inside a multi-turn response, padding) carry G through unchanged and neither add
//                 their reward nor discount. returns = G * mask; advantages = whiten(G) * mask (plain
//                 G * mask without `whiten`).
//   remax:        returns = reverse cumsum of r * mask; advantages = returns - baseline_b * mask.
// ScanArgs' fields, listed once: X(type, name, default, doc). The struct below and its Python
// binding (advantage/bindings.cpp) are both generated from this list.
#define VF_SCAN_ARGS_FIELDS(X)                                                                   \
  X(ScanKind, kind, ScanKind::gae, "which scan")                                                 \
  X(TensorRef, rewards, {}, "[B, T] float")                                                      \
  X(TensorRef, values, {}, "[B, T] float (gae)")                                                 \
  X(TensorRef, baselines, {}, "[B] float (remax)")                                               \
  X(TensorRef, mask, {}, "[B, T] bool / uint8 / int32 / int64 / float32")                        \
  X(TensorRef, advantages, {}, "out: [B, T] float32, contiguous")                                \
  X(TensorRef, returns, {}, "out: [B, T] float32, contiguous")                                   \
  X(TensorRef, status, {}, "out: int32 [status_words], 8-byte aligned")                          \
  X(TensorRef, host_status, {}, "optional out: int32 [1] on the CPU (pinned for CUDA): word 0, copied") \
  X(float, gamma, 1.0f, "discount")                                                              \
  X(float, lam, 1.0f, "GAE lambda")                                                              \
  X(bool, whiten, true, "whiten the advantages over masked positions")                           \
  X(int, num_threads, 0, "CPU threads (0: all cores)")                                           \
  X(CudaStream, stream, {}, "torch.cuda.Stream for CUDA tensors (None: the default stream)")

struct ScanArgs {
  VF_SCAN_ARGS_FIELDS(VF_RECORD_FIELD)
};

enum class GroupKind : int { grpo = 0, rloo = 1, reinforce_pp_baseline = 2 };

// Per-sample score s_b = sum_t r_bt; per group g (samples with equal id) its size n, mean, unbiased std.
//   grpo:                  a_b = (s_b - mean) / (std + epsilon), or s_b - mean without norm_by_std;
//                          a group of one has mean 0 and std 1.
//   rloo:                  a_b = n/(n-1) * (s_b - mean) for n > 1, s_b for n = 1.
//   reinforce_pp_baseline: a_b = s_b - mean (mean 0 for n = 1), then whitened over masked positions.
// advantages[b, t] = a_b * mask[b, t].
// GroupArgs' fields, listed once (see VF_SCAN_ARGS_FIELDS).
#define VF_GROUP_ARGS_FIELDS(X)                                                                  \
  X(GroupKind, kind, GroupKind::grpo, "which estimator")                                         \
  X(TensorRef, rewards, {}, "[B, T] float")                                                      \
  X(TensorRef, mask, {}, "[B, T]")                                                               \
  X(TensorRef, ids, {}, "[B] int64 on the CPU: the group of each sample")                        \
  X(TensorRef, advantages, {}, "out: [B, T] float32, contiguous")                                \
  X(TensorRef, workspace, {}, "uint8 [group_workspace_bytes(B)] on the device of the inputs")    \
  X(TensorRef, status, {}, "out: int32 [status_words], 8-byte aligned")                          \
  X(TensorRef, host_status, {}, "optional out: int32 [1] on the CPU (pinned for CUDA): word 0, copied") \
  X(float, epsilon, 1e-6f, "GRPO's std epsilon")                                                 \
  X(bool, norm_by_std, true, "GRPO: divide by the group's std")                                  \
  X(bool, whiten, true, "reinforce_pp_baseline only")                                            \
  X(int, num_threads, 0, "CPU threads (0: all cores)")                                           \
  X(CudaStream, stream, {}, "torch.cuda.Stream for CUDA tensors (None: the default stream)")

struct GroupArgs {
  VF_GROUP_ARGS_FIELDS(VF_RECORD_FIELD)
};

int64_t group_workspace_bytes(int64_t batch);

void advantage_scan(const ScanArgs& args);
void group_advantage(const GroupArgs& args);

// Groups as compressed rows: samples are numbered 0..B-1; group g holds members
// [offsets[g], offsets[g+1]) in row order; groups are numbered by first appearance.
// Returns the number of groups G. Host memory only.
int64_t build_groups(const int64_t* ids, int64_t batch, int32_t* row_group, int32_t* offsets,
                     int32_t* members);

// Workspace of the group estimators, shared by the CPU and CUDA paths.
struct GroupWorkspace {
  double* score;       // [B] s_b
  double* count;       // [B] mask sum of row b
  double* adv;         // [B] a_b
  int32_t* row_group;  // [B]
  int32_t* offsets;    // [B + 1]
  int32_t* members;    // [B]
  static GroupWorkspace at(void* base, int64_t batch) {
    auto* d = static_cast<double*>(base);
    auto* i = reinterpret_cast<int32_t*>(d + 3 * batch);
    return {d, d + batch, d + 2 * batch, i, i + batch, i + 2 * batch + 1};
  }
  static int64_t bytes(int64_t batch) { return 3 * batch * 8 + (3 * batch + 1) * 4; }
};

// a_b from the group's members' scores (see GroupArgs).
VF_HD double group_value(GroupKind kind, const double* score, const int32_t* members, int32_t begin,
                         int32_t end, double s, float epsilon, bool norm_by_std) {
  const int32_t n = end - begin;
  double mean = 0.0, var = 0.0;
  if (n > 1) {
    for (int32_t i = begin; i < end; ++i) mean += score[members[i]];
    mean /= n;
    for (int32_t i = begin; i < end; ++i) {
      const double d = score[members[i]] - mean;
      var += d * d;
    }
    var /= (n - 1);
  }
  switch (kind) {
    case GroupKind::grpo: {
      if (!norm_by_std) return s - mean;
      const double std = n > 1 ? sqrt(var) : 1.0;
      return (s - mean) / (std + epsilon);
    }
    case GroupKind::rloo:
      return n > 1 ? (s - mean) * n / (n - 1) : s;
    case GroupKind::reinforce_pp_baseline:
      return s - mean;
  }
  return 0.0;
}

#if defined(VF_WITH_CUDA)
void advantage_scan_cuda(const ScanArgs& args);
void clear_status_cuda(const TensorRef& status, uintptr_t stream);
// Queues the copy of status word 0 into host_status (when given) on `stream`.
void copy_status_to_host_cuda(const TensorRef& status, const TensorRef& host_status, uintptr_t stream);
// host_csr: row_group [B], offsets [B + 1], members [B] back to back, as build_groups wrote them.
void group_advantage_cuda(const GroupArgs& args, const int32_t* host_csr);
#endif

}  // namespace vf::advantage
