"""Per-token log-probs (and entropy) of labels under softmax(logits / T): from logits, or fused with
the lm_head so the [tokens, vocab] logits never exist.

Both ops return float32 ``logp`` of the labels' shape -- ``(logp, entropy)`` when
``with_entropy=True`` -- and are differentiable, through the entropy too (for an entropy bonus).
The temperature is applied as verl applies it (logits / T). Inputs are float32, bfloat16 or
float16; labels are integer token ids.

Dispatch: CUDA tensors run the Triton kernels (``verl_fast.kernels``); CPU tensors run a chunked
torch implementation with the same memory behaviour. ``backend="torch"`` or ``"triton"`` (or the
environment variable ``VERL_FAST_LOGPROBS_BACKEND``) forces one; Triton on CPU tensors runs only
under the Triton interpreter (``TRITON_INTERPRET=1``, used by the tests). Without Triton, CUDA
tensors take the torch path and a warning says what to install.

``check=True`` verifies that every label lies in [0, V). On the Triton path of
``logprobs_from_logits`` the forward kernel counts bad labels on the device and the call queues a
4-byte copy of the count into pinned host memory: the host never waits for it, and the first
checking call that finds it landed raises (``verl_fast.ops.pending_checks``: on the CPU the call
itself, on CUDA usually the next call, or ``raise_pending()``). Elsewhere a min/max of the labels is
read first (a wait on CUDA). ``check=False`` skips it (CUDA-graph capturable); a label outside
[0, V) then gives NaN (Triton) or an undefined value for its token.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import warnings
from typing import Dict, Optional, Tuple, Union

import torch

from verl_fast.kernels.autograd import LinearLogprobsFunction, LogprobsFunction
from verl_fast.kernels.softmax_stats import vocab_shard
from verl_fast.ops import _logprobs_torch
from verl_fast.ops import arguments as V
from verl_fast.ops import pending_checks as P
from verl_fast.ops.native import stream_handle

BACKEND_ENV = "VERL_FAST_LOGPROBS_BACKEND"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)

Result = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _float_input(x, name: str) -> torch.Tensor:
    V.tensor(x, name)
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    V.device_supported(x, name)
    return x


def _labels(labels, shape, device: torch.device, what: str) -> torch.Tensor:
    """labels as a flat contiguous int64 tensor, checked against ``shape``."""
    V.tensor(labels, "labels")
    if labels.dtype not in _LABEL_DTYPES:
        raise TypeError(f"labels must be an integer tensor (int64, int32, int16 or uint8), got {labels.dtype}")
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"labels must have shape {list(shape)} ({what}), got {list(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"labels must be on {device}, got {labels.device}")
    return labels.reshape(-1).to(torch.int64).contiguous()


def _check_range(flat: torch.Tensor, vocab: int) -> None:
    """Raises unless every label lies in [0, vocab) (a min/max read back: a wait on CUDA)."""
    message = _range_message(flat, vocab)
    if message is not None:
        raise ValueError(message)


def _range_message(flat: torch.Tensor, vocab: int, suffix: str = "") -> Optional[str]:
    if not flat.numel():
        return None
    lo, hi = torch.stack([flat.min(), flat.max()]).tolist()
    if lo < 0 or hi >= vocab:
        return f"labels must lie in [0, V) = [0, {vocab}); got values from {lo} to {hi}{suffix}"
    return None


class _Counted:
    """A bad-label counter's running total as the host last saw it land. The counter only grows:
    a call's count is its landed total minus the one before it (same stream: in order)."""

    __slots__ = ("seen",)

    def __init__(self):
        self.seen = 0


class _LabelVerdict:
    """One call's check: its counter total landed -> an error message, or None. A total that grew
    is confirmed on the call's own labels before it is reported (a call cut short between its
    launch and queuing its copy leaves a count that belongs to no call: never a false error)."""

    __slots__ = ("counted", "flat", "vocab", "device")

    def __init__(self, counted: _Counted, flat: torch.Tensor, vocab: int, device: torch.device):
        self.counted, self.flat, self.vocab, self.device = counted, flat, vocab, device

    def __call__(self, total: int) -> Optional[str]:
        grew, self.counted.seen = total != self.counted.seen, total
        if not grew:
            return None
        return _range_message(self.flat, self.vocab, P.where(self.device, "logprobs_from_logits"))


# The bad-label counter the forward kernel adds to, one per (device, stream, thread), never reset
# (see _Counted): calls on one stream run in order, so their copies land in order.
_COUNTERS: Dict[tuple, Tuple[torch.Tensor, _Counted]] = {}
_MAX_COUNTERS = 64


def _bad_label_counter(device: torch.device) -> Tuple[torch.Tensor, _Counted]:
    stream = stream_handle(device.index) if device.type == "cuda" else 0
    key = (device, stream, threading.get_ident())
    entry = _COUNTERS.get(key)
    if entry is None:
        if len(_COUNTERS) >= _MAX_COUNTERS:
            _COUNTERS.clear()
        entry = _COUNTERS[key] = (torch.zeros(1, dtype=torch.int32, device=device), _Counted())
    return entry


def _queue_label_check(counter: Tuple[torch.Tensor, _Counted], flat: torch.Tensor, vocab: int,
                       device: torch.device) -> None:
    """After the forward kernel: its counter's total copied into a pinned slot, checked when landed."""
    P.launch_checked(device, lambda slot: slot.copy_(counter[0], non_blocking=True),
                     _LabelVerdict(counter[1], flat, vocab, device))


def _inverse_temperature(temperature) -> float:
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError(f"temperature must be a number, got a tensor of shape {list(temperature.shape)}")
        temperature = temperature.item()
    return 1.0 / V.positive(temperature, "temperature")


@functools.lru_cache(maxsize=None)
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _backend(x: torch.Tensor, backend: Optional[str]) -> str:
    choice = backend or os.environ.get(BACKEND_ENV) or "auto"
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton' (argument or ${BACKEND_ENV}), got {choice!r}")
    if choice == "auto":
        if x.device.type != "cuda":
            return "torch"
        if _has_triton():
            return "triton"
        _warn_no_triton()
        return "torch"
    if choice == "triton":
        if not _has_triton():
            raise ImportError("the fused log-prob kernels need Triton: `pip install triton` (it comes with CUDA "
                              "builds of torch); backend='torch' works without it")
        if x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' on CPU tensors runs only under the Triton interpreter: set "
                             "TRITON_INTERPRET=1 before Triton is imported, or use CUDA tensors")
    return choice


@functools.lru_cache(maxsize=None)
def _warn_no_triton() -> None:
    warnings.warn("Triton is not installed, so log-probs on CUDA use the chunked torch path (slower); "
                  "`pip install triton` for the fused kernels", RuntimeWarning, stacklevel=4)


def _as_3d(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] as [B, T, V], a view whenever the leading dimensions allow one."""
    if logits.dim() == 1:
        return logits.view(1, 1, -1)
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    return logits if logits.dim() == 3 else logits.flatten(0, -3)


def _result(logp, entropy, shape, with_entropy: bool) -> Result:
    logp = logp.view(shape)
    return (logp, entropy.view(shape)) if with_entropy else logp


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         with_entropy: bool = False, *, backend: Optional[str] = None, check: bool = True,
                         config=None) -> Result:
    """log softmax(logits / T)[labels] for logits [..., V] and labels [...] -> float32 [...].

    One pass over the logits in their own dtype (no fp32 copy); the backward writes d_logits
    directly. ``config``: a ``verl_fast.kernels.logprobs_from_logits.LogprobsConfig`` for the Triton path.
    """
    _float_input(logits, "logits")
    with_entropy, check = V.flag(with_entropy, "with_entropy"), V.flag(check, "check")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {list(logits.shape)}")
    flat = _labels(labels, logits.shape[:-1], logits.device, "logits' leading dimensions")
    inv_t = _inverse_temperature(temperature)
    x = _as_3d(logits)
    if _backend(logits, backend) == "triton":
        from verl_fast.kernels.logprobs_from_logits import logprobs_from_logits_triton

        # the forward kernel counts out-of-range labels itself: the check costs one 4-byte copy
        counter = _bad_label_counter(logits.device) if check else None
        logp, entropy = logprobs_from_logits_triton(x, flat, inv_t, with_entropy, config,
                                                    counter[0] if check else None)
        if check:
            _queue_label_check(counter, flat, logits.shape[-1], logits.device)
    else:
        if check:
            _check_range(flat, logits.shape[-1])
        logp, entropy = LogprobsFunction.apply(x, flat, inv_t, with_entropy, _logprobs_torch.LOGPROBS)
    return _result(logp, entropy, labels.shape, with_entropy)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, bias: Optional[torch.Tensor] = None, tp_group=None, *,
                    backend: Optional[str] = None, check: bool = True, config=None) -> Result:
    """log softmax((hidden @ weight^T + bias) / T)[labels] without materialising the logits.

    hidden [..., H], weight [V, H] (with ``tp_group``: this rank's contiguous vocabulary shard, in
    rank order, labels holding global ids), bias [V] or None, labels [...] -> float32 [...].
    Gradients flow to hidden, weight and bias. ``config``: a
    ``verl_fast.kernels.linear_logprobs.LinearConfig`` for the Triton path (block sizes, chunking).
    """
    _float_input(hidden, "hidden")
    _float_input(weight, "weight")
    with_entropy, check = V.flag(with_entropy, "with_entropy"), V.flag(check, "check")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] < 1:
        raise ValueError(f"weight must be [V, H] with V >= 1 and H = hidden.shape[-1] = "
                         f"{hidden.shape[-1] if hidden.dim() else '?'}, got weight {list(weight.shape)} and "
                         f"hidden {list(hidden.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(f"weight must match hidden's dtype and device ({hidden.dtype}, {hidden.device}), "
                        f"got {weight.dtype}, {weight.device}")
    if bias is not None:
        V.tensor(bias, "bias")
        if bias.shape != weight.shape[:1] or bias.dtype != weight.dtype or bias.device != weight.device:
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}] in {weight.dtype} on {weight.device}, "
                             f"got {list(bias.shape)} {bias.dtype} on {bias.device}")
    _, vocab = vocab_shard(tp_group, weight.shape[0])
    flat = _labels(labels, hidden.shape[:-1], hidden.device, "hidden's leading dimensions")
    if check:
        _check_range(flat, vocab)
    inv_t = _inverse_temperature(temperature)
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.stride(-1) != 1:
        h = h.contiguous()
    if _backend(hidden, backend) == "triton":
        from verl_fast.kernels.linear_logprobs import linear_logprobs_triton

        logp, entropy = linear_logprobs_triton(h, weight, bias, flat, inv_t, with_entropy, tp_group, config)
    else:
        logp, entropy = LinearLogprobsFunction.apply(h, weight, bias, flat, inv_t, with_entropy, tp_group,
                                                     _logprobs_torch.LINEAR)
    return _result(logp, entropy, labels.shape, with_entropy)
