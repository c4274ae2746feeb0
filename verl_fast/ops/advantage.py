"""Advantage estimators over ``[B, T]`` token tensors, computed by the compiled core.

Semantics follow verl's ``core_algos`` (the field's reference, so results compare): GAE with masks that may have holes, GRPO /
Dr.GRPO, RLOO, REINFORCE++, REINFORCE++-baseline and ReMax. Inputs are CPU or CUDA tensors in
float32 / bfloat16 / float16 (float64 accepted), any strides; outputs are new float32 tensors on
the input's device. The CPU path runs C++ threads over the batch; the CUDA path runs one fused scan
kernel per call (plus a reduction and an in-place pass when whitening).

``check=True`` (the default) verifies that rewards and values are finite, that the mask holds only
0 and 1, and that whitening has at least two masked positions, raising ``ValueError`` otherwise,
without ever making the host wait for the GPU: the kernels write the verdict, the launch queues its
copy into pinned host memory, and the first checking call (of any op using
``verl_fast.ops.pending_checks``) that finds it landed raises. On the CPU that is the call itself;
on CUDA usually the next checking call on that device, or ``pending_checks.raise_pending()`` (waits,
then raises). ``check=False`` queues no check (the outputs are then undefined for such inputs).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from verl_fast.ops import arguments as V
from verl_fast.ops import pending_checks as P
from verl_fast.ops.native import cuda_stream, ext


@functools.lru_cache(maxsize=None)
def _kinds():
    """ScanKind's gae, reinforce_pp, remax (looked up once: attribute access on _C costs a call)."""
    K = ext().ScanKind
    return K.gae, K.reinforce_pp, K.remax


@functools.lru_cache(maxsize=None)
def _status_bits() -> Tuple[int, int, int, int]:
    """AdvantageStatus' bits as plain ints (pybind enum arithmetic costs microseconds a call)."""
    S = ext().AdvantageStatus
    return int(S.bad_rewards), int(S.bad_values), int(S.bad_mask), int(S.too_few_to_whiten)


class _Verdict:
    """What a call's status word means, with the names its message uses (see pending_checks)."""

    __slots__ = ("rewards_name", "values_name", "device", "op")

    def __init__(self, rewards_name: str, values_name: str, device: torch.device, op: str):
        self.rewards_name, self.values_name, self.device, self.op = rewards_name, values_name, device, op

    def __call__(self, bits: int) -> Optional[str]:
        if not bits:
            return None
        bad_rewards, bad_values, bad_mask, _ = _status_bits()
        if bits & bad_rewards:
            what = f"{self.rewards_name} contains NaN or inf"
        elif bits & bad_values:
            what = f"{self.values_name} contains NaN or inf"
        elif bits & bad_mask:
            what = "response_mask must hold only 0 and 1 (got another value)"
        else:
            what = ("whitening needs at least 2 positions where response_mask is 1; "
                    "pass whiten=False for such batches")
        return what + P.where(self.device, self.op)


_VERDICTS: Dict[tuple, _Verdict] = {}  # by (names, device, op): a verdict keeps no state of its call


def _verdict(rewards_name: str, values_name: str, device: torch.device, op: str) -> _Verdict:
    key = (rewards_name, values_name, device, op)
    verdict = _VERDICTS.get(key)
    if verdict is None:
        verdict = _VERDICTS[key] = _Verdict(rewards_name, values_name, device, op)
    return verdict


def _launch_checked(launcher, args, device: torch.device, verdict: _Verdict) -> None:
    """``launcher(args)`` with a pending check: the status word's copy goes into the slot in args.host_status."""
    def launch(slot: torch.Tensor) -> None:
        args.host_status = slot
        launcher(args)

    P.launch_checked(device, launch, verdict)


# One status record per (device, stream, thread), kept: calls on one stream run in order, each clears
# the record before its kernels write it and queues the copy of its word 0 (pending_checks) after them.
_STATUS: Dict[tuple, torch.Tensor] = {}
_MAX_STATUS = 64  # streams and threads come and go: beyond this many records, start again
_DEVICES = ("cpu", "cuda")


def _status(device: torch.device, stream) -> torch.Tensor:
    """The status record for calls on ``stream`` (None: the CPU) from this thread."""
    key = (device, stream.cuda_stream if stream is not None else 0, threading.get_ident())
    record = _STATUS.get(key)
    if record is None:
        if len(_STATUS) >= _MAX_STATUS:
            _STATUS.clear()
        record = _STATUS[key] = torch.empty(ext().status_words, dtype=torch.int32, device=device)
    return record


def _outputs(B: int, T: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two new [B, T] float32 tensors from one allocation (one allocator call on the host's path)."""
    adv, ret = torch.empty((2, B, T), dtype=torch.float32, device=device).unbind(0)
    return adv, ret


def _unit(x, name: str) -> float:
    """A discount or mixing weight: a float in [0, 1] (the plain case checked first: it is every call)."""
    if type(x) is float and 0.0 <= x <= 1.0:
        return x
    # a discount or mixing weight outside [0, 1] grows the returns geometrically (1e30: all inf / NaN)
    return V.in_range(x, name, 0.0, 1.0)


def _scan(kind, rewards, mask, *, values=None, baselines=None, gamma=1.0, lam=1.0, whiten=True,
          check=True, values_name="values", op="compute_gae") -> Tuple[torch.Tensor, torch.Tensor]:
    C = ext()
    B, T = rewards.shape
    device = rewards.device
    stream = cuda_stream(rewards)
    adv, ret = _outputs(B, T, device)
    status = _status(device, stream)
    a = C.ScanArgs()
    a.kind = kind
    a.rewards = rewards
    if values is not None:
        a.values = values
    if baselines is not None:
        a.baselines = baselines
    a.mask = mask  # bool crosses as it is: the core reads its bytes as uint8
    a.advantages = adv
    a.returns = ret
    a.status = status
    a.gamma = _unit(gamma, "gamma")
    a.lam = _unit(lam, "lam")
    a.whiten = whiten if whiten is True or whiten is False else V.flag(whiten, "whiten")
    a.num_threads = torch.get_num_threads()
    a.stream = stream
    checked = check is True or (check is not False and V.flag(check, "check"))
    if not checked:
        C.advantage_scan(a)
        return adv, ret
    _launch_checked(C.advantage_scan, a, device, _verdict("token_level_rewards", values_name, device, op))
    return adv, ret


def _gae_inputs(r, v, m):
    """compute_gae's tensors, checked: the common case (plain tensors of supported dtypes, one shape,
    one device) in a few comparisons; anything else through the checks that name what is wrong."""
    if (type(r) is torch.Tensor and type(v) is torch.Tensor and type(m) is torch.Tensor and r.dim() == 2
            and r.dtype in V.FLOAT_DTYPES and v.dtype in V.FLOAT_DTYPES and m.dtype in V.MASK_DTYPES
            and r.shape == v.shape == m.shape and r.device == v.device == m.device and r.device.type in _DEVICES):
        return r, v, m
    r = V.float_2d(r, "token_level_rewards")
    V.device_supported(r, "token_level_rewards")
    v = V.same_shape(v, "values", r, "token_level_rewards")
    V.float_dtype(v, "values")
    m = V.mask(m, "response_mask", r, "token_level_rewards")
    return r, v, m


def compute_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    *,
    check: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation. Returns ``(advantages, returns)``, both ``[B, T]`` float32.

    ``delta_t = r_t + gamma*V_next - V_t``, ``A_t = delta_t + gamma*lam*A_{t+1}``; where the mask is 0
    the next value and the running advantage pass through unchanged. ``returns = A + V``; the
    advantages are whitened over masked positions (unbiased variance) unless ``whiten=False``.
    """
    r, v, m = _gae_inputs(token_level_rewards, values, response_mask)
    return _scan(_kinds()[0], r, m, values=v, gamma=gamma, lam=lam, whiten=whiten, check=check)


def compute_reinforce_pp_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    whiten: bool = True,
    *,
    check: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns over the masked positions, whitened over the mask.

    ``G_t = r_t + gamma*G_{t+1}`` where the mask is set; masked-out positions inside a response
    (multi-turn observation spans) carry the running return through unchanged (no reward added, no
    discount). Returns ``(advantages, returns)``, both 0 outside the mask.
    """
    r = V.float_2d(token_level_rewards, "token_level_rewards")
    V.device_supported(r, "token_level_rewards")
    m = V.mask(response_mask, "response_mask", r, "token_level_rewards")
    return _scan(_kinds()[1], r, m, gamma=gamma, whiten=whiten, check=check, op="compute_reinforce_pp_advantage")


def compute_remax_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    check: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """ReMax: returns are the reverse cumulative sum of masked rewards; advantages subtract the
    per-sample baseline (the greedy rollout's reward) at masked positions."""
    r = V.float_2d(token_level_rewards, "token_level_rewards")
    V.device_supported(r, "token_level_rewards")
    base = V.tensor(reward_baselines, "reward_baselines")
    if base.dim() != 1 or base.shape[0] != r.shape[0]:
        raise ValueError(
            f"reward_baselines must be a 1-D tensor of shape [B] = [{r.shape[0]}], got {list(base.shape)}"
        )
    V.float_dtype(base, "reward_baselines")
    if base.device != r.device:
        raise ValueError(f"reward_baselines must be on {r.device}, got {base.device}")
    m = V.mask(response_mask, "response_mask", r, "token_level_rewards")
    return _scan(_kinds()[2], r, m, baselines=base, whiten=False, check=check,
                 values_name="reward_baselines", op="compute_remax_advantage")


def group_ids(index: Any, batch: int) -> torch.Tensor:
    """Group ids as a contiguous int64 CPU tensor: ints (list, numpy, tensor) pass through; any
    other hashable ids (uid strings, tuples) are numbered by first appearance."""
    if isinstance(index, torch.Tensor):
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise TypeError(f"index must hold integer group ids, got a {index.dtype} tensor")
        ids = index.detach().to("cpu", torch.int64).reshape(-1)
    elif isinstance(index, np.ndarray) and index.dtype.kind in "iu":
        ids = torch.from_numpy(index.astype(np.int64, copy=False).reshape(-1))
    else:
        if isinstance(index, np.ndarray):
            index = index.tolist()
        if not isinstance(index, Sequence) or isinstance(index, (str, bytes)):
            raise TypeError(f"index must be a sequence, numpy array or tensor of group ids, got {type(index).__name__}")
        if all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in index):
            ids = torch.tensor([int(i) for i in index], dtype=torch.int64)
        else:
            numbering: dict = {}
            try:
                ids = torch.tensor([numbering.setdefault(i, len(numbering)) for i in index], dtype=torch.int64)
            except TypeError as e:
                raise TypeError(f"index entries must be hashable group ids: {e}") from None
    if ids.numel() != batch:
        raise ValueError(f"index must have one group id per sample: {batch} expected, got {ids.numel()}")
    return ids.contiguous()


def _group(kind, token_level_rewards, response_mask, index, *, epsilon=1e-6, norm_by_std=True,
           whiten=True, check=True, op) -> torch.Tensor:
    C = ext()
    r = V.float_2d(token_level_rewards, "token_level_rewards")
    V.device_supported(r, "token_level_rewards")
    m = V.mask(response_mask, "response_mask", r, "token_level_rewards")
    B, T = r.shape
    ids = group_ids(index, B)
    adv = torch.empty((B, T), dtype=torch.float32, device=r.device)
    stream = cuda_stream(r)
    status = _status(r.device, stream)
    a = C.GroupArgs()
    a.kind = kind
    a.rewards = r
    a.mask = m
    a.ids = ids
    a.advantages = adv
    a.workspace = torch.empty(C.group_workspace_bytes(B), dtype=torch.uint8, device=r.device)
    a.status = status
    # epsilon keeps a group of equal scores (std 0) from dividing 0 by 0
    a.epsilon = V.positive(epsilon, "epsilon")
    a.norm_by_std = V.flag(norm_by_std, "norm_by_std")
    a.whiten = V.flag(whiten, "whiten")
    a.num_threads = torch.get_num_threads()
    a.stream = stream
    if not V.flag(check, "check"):
        C.group_advantage(a)
        return adv
    verdict = _verdict("token_level_rewards", "token_level_rewards", r.device, op)
    _launch_checked(C.group_advantage, a, r.device, verdict)
    return adv


def compute_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
    *,
    check: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: ``(s - mean_g) / (std_g + epsilon)`` per sample, broadcast over the mask.

    ``s`` is the sum of the sample's token rewards; mean and unbiased std are over its group (samples
    sharing an ``index`` entry); a group of one has mean 0 and std 1. ``norm_by_std=False`` is
    Dr.GRPO (no division). ``epsilon`` must be > 0 (a group of equal rewards has std 0). Returns
    ``(advantages, returns)``, which are equal.
    """
    adv = _group(ext().GroupKind.grpo, token_level_rewards, response_mask, index, epsilon=epsilon,
                 norm_by_std=norm_by_std, check=check, op="compute_grpo_advantage")
    return adv, adv


def compute_drgrpo_advantage(token_level_rewards, response_mask, index, *, check: bool = True):
    """Dr.GRPO: GRPO without the division by the group's standard deviation."""
    return compute_grpo_advantage(token_level_rewards, response_mask, index, norm_by_std=False, check=check)


def compute_rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    *,
    check: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """RLOO: each sample's score minus the mean of the other samples of its group
    (``n/(n-1) * (s - mean_g)``); a group of one keeps its score. Returns ``(advantages, returns)``."""
    adv = _group(ext().GroupKind.rloo, token_level_rewards, response_mask, index, check=check,
                 op="compute_rloo_advantage")
    return adv, adv


def compute_reinforce_pp_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    whiten: bool = True,
    *,
    check: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: score minus the group mean, broadcast over the mask, whitened over the
    masked positions. Returns ``(advantages, returns)``, which are equal."""
    adv = _group(ext().GroupKind.reinforce_pp_baseline, token_level_rewards, response_mask, index,
                 whiten=whiten, check=check, op="compute_reinforce_pp_baseline_advantage")
    return adv, adv


__all__ = [
    "compute_gae",
    "compute_grpo_advantage",
    "compute_drgrpo_advantage",
    "compute_rloo_advantage",
    "compute_reinforce_pp_advantage",
    "compute_reinforce_pp_baseline_advantage",
    "compute_remax_advantage",
    "group_ids",
]
