"""The length-bucketed batch scheduler: plans computed by the compiled core (``csrc/schedule``).

Three plans, each a :class:`Plan` (a sequence of index arrays plus a quality report):

- :func:`balance_partitions` — split a batch over ``k`` data-parallel ranks so that each rank's cost
  (tokens, or verl's FLOP proxy ``a*L + L^2``) is nearly equal: k-way Karmarkar–Karp (largest
  differencing), optionally with equal counts per rank.
- :func:`pack_micro_batches` — micro-batches whose tokens stay within ``max_tokens``, as few as
  possible, balanced where the budget allows; ranks can agree on one count.
- :func:`rollout_buckets` — dispatch waves for the rollout engine: requests grouped by prompt length,
  each wave with its own ``max_tokens``, within a sequence and KV-token budget per wave.

Lengths may be a list, a numpy array or a torch integer tensor (CUDA tensors are copied to the
host). Index arrays come back as numpy int64, or as CPU torch int64 tensors when the lengths were a
torch tensor. Plans are deterministic: the same lengths give the same plan on every rank.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from verl_fast.ops import arguments as V
from verl_fast.ops.native import ext

__all__ = ["Plan", "PlanReport", "balance_partitions", "pack_micro_batches", "rollout_buckets", "FLOPS_A"]

# verl's FLOP proxy for a 7B dense model (hidden 4096): 12*h^2*L + 2*h*L^2, proportional to 24576*L + L^2.
FLOPS_A = 24576

Lengths = Union[Sequence[int], np.ndarray, torch.Tensor]


@dataclass(frozen=True)
class PlanReport:
    """How good a plan is.

    ``padded_utilisation``: real tokens / tokens when each group is padded to its longest member.
    ``budget_utilisation``: real tokens / (groups * budget) — packing and rollout plans only (a
    group over the budget, an oversize sequence alone, counts as its own cost).
    ``imbalance``: largest group cost / mean group cost (1.0 is perfect balance).
    """

    num_groups: int
    real_tokens: int
    padded_utilisation: float
    budget_utilisation: Optional[float]
    imbalance: float
    num_oversize: int = 0

    def as_dict(self, prefix: str = "") -> Dict[str, float]:
        """Flat metrics for logging, keys prefixed (e.g. ``"schedule/"``)."""
        out = {f"{prefix}num_groups": float(self.num_groups), f"{prefix}real_tokens": float(self.real_tokens),
               f"{prefix}padded_utilisation": self.padded_utilisation, f"{prefix}imbalance": self.imbalance,
               f"{prefix}num_oversize": float(self.num_oversize)}
        if self.budget_utilisation is not None:
            out[f"{prefix}budget_utilisation"] = self.budget_utilisation
        return out


@dataclass(frozen=True, eq=False)
class Plan(Sequence):
    """Groups of sequence indices (``plan[g]``, ``len(plan)``, iteration) and their figures.

    ``costs[g]``: the cost the plan balances or budgets (partition cost, micro-batch budget use,
    a wave's worst-case KV tokens). ``tokens[g]``: real tokens in group g. ``oversize``: indices of
    sequences over the budget, each alone in its group. ``max_tokens[g]``: rollout waves only.
    """

    groups: List[Union[np.ndarray, torch.Tensor]]
    costs: np.ndarray
    tokens: np.ndarray
    report: PlanReport
    oversize: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    max_tokens: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, g):
        return self.groups[g]

    def __iter__(self) -> Iterator:
        return iter(self.groups)


# ---------------------------------------------------------------- argument checks


def _as_lengths(x, name: str) -> Tuple[np.ndarray, bool]:
    """(int64 numpy copy-free view where possible, whether x was a torch tensor)."""
    is_torch = isinstance(x, torch.Tensor)
    if is_torch:
        if x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex:
            raise TypeError(f"{name} must hold integers (token counts), got a {x.dtype} tensor")
        arr = x.detach().to("cpu", torch.int64).contiguous().numpy()
    elif isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers (token counts), got a numpy {x.dtype} array")
        if x.dtype == np.uint64 and x.size and x.max() > np.iinfo(np.int64).max:
            raise ValueError(f"{name} holds values beyond int64")
        arr = np.ascontiguousarray(x, dtype=np.int64)
    elif isinstance(x, (str, bytes)) or not hasattr(x, "__len__"):
        raise TypeError(f"{name} must be a 1-D sequence of integers, got {type(x).__name__}")
    else:
        flag = next((v for v in x if isinstance(v, (bool, np.bool_))), None)
        if flag is not None:  # numpy would read True as 1
            raise TypeError(f"{name} must hold integers (token counts), got {flag!r} (bool)")
        arr = np.asarray(x) if len(x) else np.zeros(0, dtype=np.int64)
        if arr.dtype.kind not in "iu":
            bad = [v for v in np.ravel(arr) if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral)]
            if not bad:  # Python ints beyond int64 make an object array
                raise ValueError(f"{name} holds values beyond int64")
            bad = bad[0]
            raise TypeError(f"{name} must hold integers (token counts), got {bad!r} ({type(bad).__name__})")
        arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one length per sequence), got shape {list(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"{name} must hold at least one sequence, got none")
    if arr.min() < 1:
        i = int(np.argmin(arr))
        raise ValueError(f"{name} must be >= 1 everywhere, got {int(arr[i])} at index {i}")
    return arr, is_torch




def _cost_coefficients(cost, flops_a: int) -> Tuple[int, int]:
    if isinstance(cost, str):
        if cost == "tokens":
            return 1, 0
        if cost == "flops":
            return V.size(flops_a, "flops_a", 0), 1
        raise ValueError(f"cost must be 'tokens', 'flops' or (linear, quadratic) integers, got {cost!r}")
    if isinstance(cost, (tuple, list)) and len(cost) == 2:
        linear, quadratic = (V.size(c, "cost coefficients", 0) for c in cost)
        if linear == 0 and quadratic == 0:
            raise ValueError("cost coefficients (linear, quadratic) must not both be 0")
        return linear, quadratic
    raise TypeError(f"cost must be 'tokens', 'flops' or a (linear, quadratic) pair of ints, got {cost!r}")


# ---------------------------------------------------------------- plan figures


def _group_stats(lengths: np.ndarray, order: np.ndarray, offsets: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(token sum, longest member) of each group; 0 for empty groups."""
    sizes = np.diff(offsets)
    csum = np.concatenate(([0], np.cumsum(lengths[order], dtype=np.int64)))
    tokens = csum[offsets[1:]] - csum[offsets[:-1]]
    longest = np.zeros(len(sizes), dtype=np.int64)
    nonempty = sizes > 0
    if nonempty.any():
        longest[nonempty] = np.maximum.reduceat(lengths[order], offsets[:-1][nonempty])
    return tokens, longest


def _make_plan(lengths: np.ndarray, order: np.ndarray, offsets: np.ndarray, costs: np.ndarray, as_torch: bool,
               budget: Optional[int] = None, oversize: Optional[np.ndarray] = None,
               max_tokens: Optional[np.ndarray] = None, padded_tokens: Optional[int] = None) -> Plan:
    tokens, longest = _group_stats(lengths, order, offsets)
    real = int(lengths.sum())
    padded = int((np.diff(offsets) * longest).sum()) if padded_tokens is None else padded_tokens
    k = len(offsets) - 1
    mean_cost = float(costs.sum()) / k
    report = PlanReport(
        num_groups=k,
        real_tokens=real,
        padded_utilisation=real / padded,
        # an oversize group (alone over the budget) counts as exactly full
        budget_utilisation=None if budget is None else real / float(np.maximum(costs, budget).sum()),
        imbalance=float(costs.max()) / mean_cost if mean_cost > 0 else 1.0,
        num_oversize=0 if oversize is None else len(oversize),
    )
    groups = np.split(order, offsets[1:-1])
    if as_torch:
        groups = [torch.from_numpy(g) for g in groups]
    return Plan(groups=groups, costs=costs, tokens=tokens, report=report,
                oversize=np.zeros(0, dtype=np.int64) if oversize is None else oversize, max_tokens=max_tokens)


# ---------------------------------------------------------------- the three plans


def balance_partitions(lengths: Lengths, k: int, equal_size: bool = True, cost="tokens", *,
                       flops_a: int = FLOPS_A) -> Plan:
    """Split sequences over ``k`` partitions (data-parallel ranks) with nearly equal cost.

    ``cost``: ``"tokens"`` (L), ``"flops"`` (``flops_a * L + L^2``, verl's proxy with
    ``flops_a = 24576``), or a ``(linear, quadratic)`` pair of non-negative ints for
    ``linear * L + quadratic * L^2``. ``equal_size=True`` gives every partition ``n / k`` sequences
    (``k`` must divide ``n``); otherwise partitions may differ in count. ``k > n`` is a ValueError
    (no empty partitions). Partitions come largest cost first; indices inside each are ascending.
    Costs beyond int64 are a ValueError naming the length.
    ``report.imbalance`` is max / mean partition cost.
    """
    arr, as_torch = _as_lengths(lengths, "lengths")
    n = len(arr)
    k = V.size(k, "k", 1)
    equal_size = V.flag(equal_size, "equal_size")
    if k > n:
        raise ValueError(f"k must be <= the number of sequences ({n}), got {k}")
    if equal_size and n % k:
        raise ValueError(f"equal_size=True needs k to divide the number of sequences: {n} % {k} = {n % k} "
                         "(pass equal_size=False, or drop or pad sequences)")
    linear, quadratic = _cost_coefficients(cost, flops_a)
    order = torch.empty(n, dtype=torch.int64)
    offsets = torch.empty(k + 1, dtype=torch.int64)
    costs = torch.empty(k, dtype=torch.int64)
    ext().balance_partitions(torch.from_numpy(arr), k, bool(equal_size), linear, quadratic, order, offsets, costs)
    return _make_plan(arr, order.numpy(), offsets.numpy(), costs.numpy(), as_torch)


def reduce_over(group, value, op: str = "max", dtype=torch.int64):
    """``value`` all-reduced (``"max"`` or ``"sum"``) over a torch.distributed process group, as a
    Python number (on the device the group's backend works with)."""
    from verl_fast.distributed import all_reduce_numbers

    return all_reduce_numbers([value], op, group, dtype)[0]


def pack_micro_batches(lengths: Lengths, max_tokens: int, min_num: int = 1, same_count_across=None, *,
                       layout: str = "packed") -> Plan:
    """Micro-batches whose tokens stay within ``max_tokens``, as few as possible.

    ``layout="packed"`` (sequences concatenated without padding, as with ``use_remove_padding``):
    a micro-batch's budget use is its token sum. The count is the fewest that best-fit decreasing or
    Karmarkar–Karp at the lower bound ``ceil(total / max_tokens)`` finds; at that count the
    micro-batches are Karmarkar–Karp balanced when that fits the budget. ``layout="padded"``: budget
    use is members * longest member; sequences are cut longest first into consecutive runs.

    A sequence longer than ``max_tokens`` gets a micro-batch of its own and is listed in
    ``plan.oversize`` (never dropped). There are at least ``min_num`` micro-batches.

    ``same_count_across``: make data-parallel ranks agree on one count (each rank must run the same
    number of forward/backward passes). Either a ``torch.distributed`` process group — the ranks'
    counts are all-reduced with MAX and every rank splits up to it — or an int, the count already
    agreed on (a ValueError if this rank needs more). Micro-batches come largest first.
    """
    arr, as_torch = _as_lengths(lengths, "lengths")
    n = len(arr)
    max_tokens = V.size(max_tokens, "max_tokens", 1)
    min_num = V.size(min_num, "min_num", 1)
    if layout not in ("packed", "padded"):
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    agreed = None
    if isinstance(same_count_across, numbers.Integral) and not isinstance(same_count_across, bool):
        agreed = V.size(same_count_across, "same_count_across", 1)
    elif same_count_across is not None and not _is_process_group(same_count_across):
        raise TypeError("same_count_across must be None, an int (the agreed count) or a torch.distributed "
                        f"process group, got {type(same_count_across).__name__}")
    target = max(min_num, agreed or 1)
    if target > n:
        raise ValueError(f"cannot make {target} micro-batches from {n} sequences "
                         "(min_num / same_count_across must be <= the number of sequences)")
    padded = layout == "padded"
    C = ext()
    src = torch.from_numpy(arr)
    order = torch.empty(n, dtype=torch.int64)
    offsets = torch.empty(n + 1, dtype=torch.int64)
    count = C.pack_micro_batches(src, max_tokens, target, padded, order, offsets)
    if agreed is not None and count != agreed:
        raise ValueError(f"same_count_across={agreed} is fewer than the {count} micro-batches this rank needs "
                         f"(max_tokens={max_tokens}, min_num={min_num})")
    if same_count_across is not None and agreed is None:
        most = int(reduce_over(same_count_across, count, "max"))
        if most > n:
            raise ValueError(f"another rank needs {most} micro-batches but this rank has only {n} sequences; "
                             "give every rank the same batch size")
        if most > count:
            count = C.pack_micro_batches(src, max_tokens, most, padded, order, offsets)
    order_np, offsets_np = order.numpy(), offsets.numpy()[: count + 1]
    tokens, longest = _group_stats(arr, order_np, offsets_np)
    costs = np.diff(offsets_np) * longest if padded else tokens
    oversize = np.flatnonzero(arr > max_tokens).astype(np.int64)
    return _make_plan(arr, order_np, offsets_np, costs, as_torch, budget=max_tokens, oversize=oversize)


def _is_process_group(obj) -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return dist.is_available() and isinstance(obj, dist.ProcessGroup)


def rollout_buckets(prompt_lens: Lengths, max_new_tokens, max_num_seqs: int, max_batch_tokens: int, *,
                    max_model_len: Optional[int] = None, max_length_ratio: float = 2.0) -> Plan:
    """Dispatch waves for the rollout engine, short prompts first.

    Requests are sorted by prompt length (then by their max new tokens) and cut into consecutive
    waves of at most ``max_num_seqs`` requests whose worst-case KV tokens — the wave's prompt
    tokens plus members * the wave's ``max_tokens`` — stay within ``max_batch_tokens``, and whose
    longest prompt is at most ``max_length_ratio`` times the shortest (``float("inf")``: no limit).
    So requests of similar length run together and short ones are not held behind long ones.
    ``max_new_tokens`` is an int or one per request; with ``max_model_len`` each is clipped to
    ``max_model_len - prompt_len``.
    ``plan.max_tokens[w]`` is wave w's generation limit (the largest of its members'); a request
    that alone exceeds ``max_batch_tokens`` gets a wave of its own and is listed in
    ``plan.oversize``. ``costs[w]``: the wave's worst-case KV tokens; the report counts each
    request's prompt + max new tokens as its real tokens.
    """
    p, as_torch = _as_lengths(prompt_lens, "prompt_lens")
    n = len(p)
    if isinstance(max_new_tokens, numbers.Integral) and not isinstance(max_new_tokens, bool):
        m = np.full(n, V.size(max_new_tokens, "max_new_tokens", 1), dtype=np.int64)
    else:
        m, _ = _as_lengths(max_new_tokens, "max_new_tokens")
        if len(m) != n:
            raise ValueError(f"max_new_tokens must be an int or one per prompt ({n}), got {len(m)}")
    max_num_seqs = V.size(max_num_seqs, "max_num_seqs", 1)
    max_batch_tokens = V.size(max_batch_tokens, "max_batch_tokens", 1)
    model_len = 0 if max_model_len is None else V.size(max_model_len, "max_model_len", 2)
    if isinstance(max_length_ratio, bool) or not isinstance(max_length_ratio, numbers.Real) \
            or not max_length_ratio >= 1:
        raise ValueError(f"max_length_ratio must be a number >= 1 (inf for no limit), got {max_length_ratio!r}")
    if model_len and p.max() >= model_len:
        i = int(np.argmax(p))
        raise ValueError(f"prompt_lens[{i}] = {int(p[i])} leaves no room for a response within "
                         f"max_model_len = {model_len}")
    order = torch.empty(n, dtype=torch.int64)
    offsets = torch.empty(n + 1, dtype=torch.int64)
    wave_max = torch.empty(n, dtype=torch.int64)
    count = ext().rollout_buckets(torch.from_numpy(p), torch.from_numpy(m), max_num_seqs, max_batch_tokens,
                                  model_len, float(max_length_ratio), order, offsets, wave_max)
    m_eff = np.minimum(m, model_len - p) if model_len else m
    order_np, offsets_np, wave_max_np = order.numpy(), offsets.numpy()[: count + 1], wave_max.numpy()[:count]
    prompt_tokens, longest_prompt = _group_stats(p, order_np, offsets_np)
    sizes = np.diff(offsets_np)
    costs = prompt_tokens + sizes * wave_max_np
    oversize = np.flatnonzero(p + m_eff > max_batch_tokens).astype(np.int64)
    total = p + m_eff
    return _make_plan(total, order_np, offsets_np, costs, as_torch, budget=max_batch_tokens, oversize=oversize,
                      max_tokens=wave_max_np, padded_tokens=int((sizes * (longest_prompt + wave_max_np)).sum()))
