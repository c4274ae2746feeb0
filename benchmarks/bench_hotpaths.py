"""The hot paths as users call them (issue 48): each op's default call before and after this issue's
host-path changes, side by side in one process, with the baseline and the floor.

    python benchmarks/bench_hotpaths.py [--device cuda|cpu] [--cases gae,logprobs,reshard,linear,linear05,host]

Each op is timed two ways (CUDA events; medians):
- ``called``: the GPU idle when the call starts, so the host's work before its first launch counts
  (a user timing one call, or a step whose GPU has drained);
- ``busy``: a 1 GiB fill queued before each call, so the host's work overlaps GPU work and only
  what the call makes the host wait for (its read-backs) still shows.
``waiting check`` rows run it with the checks waiting for the device before they read their verdict,
as they did before the checks stopped waiting (``waiting_checks()``); ``after #48`` rows are the default call now.
``before #48`` rows run the same public call with this issue's host-path changes switched back off
(``before_48()``: per-call allocations, the status word read through pybind enums, every argument
through the named checks, the label counter zeroed per call, the autograd context always entered,
one allocation and one conversion per reshard output).

Cases (CUDA sizes; CPU: small, to check the script):
  gae 1024x4096           default, check=False, graph replay | Python loop | floor: 17 B an element once
  gae_rows                the scan alone (graph replay, no whitening, no check) as the row count and the row
                          length change: what bounds it (a row's chain of tiles, or the memory's rate)
  logprobs 8192x151936    default (label check), check=False  | fp32 log_softmax | floor: read the logits once
  reshard one-shot 7B     vllm_weights default (new outputs)  | per-parameter torch.cat | floor: bytes at copy speed
  linear 8192x3584x151936 fwd+bwd per chunk size / d_hidden GEMM / logits kept (store_logits);
  linear05: the same head at the 0.5B hidden size (8192x896x151936), default and logits kept
                          | matmul + log_softmax | floor: 3 GEMMs (meta: one GEMM's time, so 4)
  host                    the wrappers' host time per call with 2x8 tensors, on the CPU and the --device
                          GPU, with the torch ops each call launches and its read-backs (waits for the GPU
                          on CUDA); compute_gae's host path piece by piece
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, copy_bandwidth_gbs, peak_extra_bytes, sync, time_ms  # noqa: E402
from bench_advantage import gae_inputs, graph_ms, loop_gae  # noqa: E402
from bench_e2e import kernel_profile  # noqa: E402

import verl_fast as vf  # noqa: E402
from verl_fast.bench.shapes import shape  # noqa: E402
from verl_fast.ops import pending_checks as _P  # noqa: E402

_RAISE_LANDED = _P.raise_landed

CASES = ("gae", "gae_rows", "logprobs", "reshard", "linear", "linear05", "host")


# ------------------------------------------------------------------ the host paths before issue 48


def _old_status(device, stream):
    return torch.empty(vf.ops.advantage.ext().status_words, dtype=torch.int32, device=device)


def _waiting_raise_landed(device):
    """The checks as they ran before pending_checks: wait for the device, then read the verdict."""
    from verl_fast.ops import pending_checks as P

    P._wait(device)
    _RAISE_LANDED(device)


def _old_gae_inputs(r, v, m):
    from verl_fast.ops import arguments as V

    r = V.float_2d(r, "token_level_rewards")
    V.device_supported(r, "token_level_rewards")
    v = V.same_shape(v, "values", r, "token_level_rewards")
    V.float_dtype(v, "values")
    return r, v, V.mask(m, "response_mask", r, "token_level_rewards")


def _old_execute_new(self, sources, *, device=None):
    srcs = self._ordered(sources, self.src_tensors, "source", self.src_aliases)
    dev = device or next((x.device for x in srcs if x.numel()), torch.device("cpu"))
    _, dsts, bound = self.bind(srcs, list(self.allocate_destinations(dev).values()))
    self.run(bound)
    return dsts


@contextlib.contextmanager
def before_48():
    """The public calls as they ran before issue 48's host-path changes."""
    from verl_fast.kernels import autograd as AG
    from verl_fast.kernels import logprobs_from_logits as LF
    from verl_fast.ops import arguments as V
    from verl_fast.ops import advantage as A
    from verl_fast.ops import logprobs as L
    from verl_fast.ops.reshard.plan import ReshardPlan

    patches = [
        mock.patch.object(A, "_status", _old_status),
        mock.patch.object(A, "_outputs", lambda B, T, d: (torch.empty((B, T), device=d), torch.empty((B, T), device=d))),
        mock.patch.object(_P, "raise_landed", _waiting_raise_landed),
        mock.patch.object(A, "_gae_inputs", _old_gae_inputs),
        mock.patch.object(A, "_unit", lambda x, name: V.in_range(x, name, 0.0, 1.0)),
        mock.patch.object(AG, "_as_implemented", AG._switched),
        mock.patch.object(LF, "logprobs_config", LF.logprobs_config.__wrapped__),
        mock.patch.object(L, "_bad_label_counter",
                          lambda d: (torch.zeros(1, dtype=torch.int32, device=d), L._Counted())),
        mock.patch.object(ReshardPlan, "execute_new", _old_execute_new),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


@contextlib.contextmanager
def waiting_checks():
    """The public calls as they ran before the checks stopped waiting: everything as
    now, except that a checking call waits for the device before it reads its verdict."""
    with mock.patch.object(_P, "raise_landed", _waiting_raise_landed):
        yield


# The rows each op is timed under: the host path before issue 48, with checks that wait for the GPU
# (issue 48's first host changes, before pending_checks), and now (the default call as users make it).
STAGES = (("before #48", before_48), ("waiting check", waiting_checks), ("after #48", contextlib.nullcontext))


def both_ways(report: Report, case: str, impl: str, fn, device: str, **timing) -> None:
    """Rows ``impl, called`` and (CUDA) ``impl, busy`` for ``fn`` (see the module docstring)."""
    report.add(case, f"{impl}, called", time_ms(fn, device, **timing))
    if device.startswith("cuda"):
        report.add(case, f"{impl}, busy", time_ms(fn, device, busy_gpu=True, **timing))


# ------------------------------------------------------------------ host cost per call

# Ops that only allocate or make a view: no kernel on a GPU. Any other leaf op launches one; the
# read-backs (a wait for the GPU on CUDA) are counted apart.
_NO_LAUNCH = {"aten::empty", "aten::empty_strided", "aten::as_strided", "aten::view", "aten::_reshape_alias",
              "aten::alias", "aten::detach", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg"}
_READ_BACKS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::is_nonzero"}


def torch_ops(fn):
    """(ops that would launch a kernel, read-backs) of one call of ``fn``: the leaf aten ops from
    torch's CPU profiler (an op calling others counts as those; _C's own launches are not aten ops),
    and the reads of device values on the host (item, tolist, bool, a wait in pending_checks), each
    a wait for the GPU on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    reads = []

    def counted(name, real):
        def read(*args, **kwargs):
            reads.append(name)
            return real(*args, **kwargs)
        return read

    with contextlib.ExitStack() as stack:
        for name in ("tolist", "__bool__"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, counted(name, getattr(torch.Tensor, name))))
        stack.enter_context(mock.patch.object(_P, "_wait", counted("wait", _P._wait)))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    leaves = [e.name for e in prof.events() if e.name.startswith("aten::") and not e.cpu_children]
    reads += [n for n in leaves if n in _READ_BACKS]
    return [n for n in leaves if n not in _NO_LAUNCH and n not in _READ_BACKS], reads


def host_us(fn, device: str = "cpu", calls: int = 2000, rounds: int = 5) -> float:
    """Microseconds of host time per call: the best of ``rounds`` loops of ``calls`` (a shared CPU's
    noise only ever adds). With tiny CUDA tensors the GPU keeps up, so this is the host's time there
    too (one wait per loop)."""
    for _ in range(100):
        fn()
    sync(device)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def add_host_rows(rep: Report, case: str, calls, device: str) -> None:
    """Rows ``<stage> <impl>`` under ``case``: host ms per call, the launch and read-back counts in
    the impl (meta has the microseconds)."""
    for label, ctx in STAGES:
        with ctx():
            for impl, fn in calls:
                launches, reads = torch_ops(fn)
                us = host_us(fn, device)
                rep.meta[f"host_us {case} {label} {impl}"] = us
                rep.add(case, f"{label} {impl}: {len(launches)} launches, {len(reads)} read-backs", us / 1e3,
                        note=f"torch ops {launches}, reads {reads} (+ _C's own launches)")


def add_piece_rows(rep: Report, case: str, pieces, device: str) -> None:
    """A row ``  piece: <name>`` under ``case`` per (name, fn) of ``pieces``: host ms per call."""
    for piece, fn in pieces:
        us = host_us(fn, device)
        rep.meta[f"host_us {case} piece {piece}"] = us
        rep.add(case, f"  piece: {piece}", us / 1e3)


def gae_pieces(r, v, m):
    """compute_gae's host path piece by piece, each as the call runs it (see ops/advantage.py)."""
    from verl_fast.ops import advantage as A
    from verl_fast.ops.native import cuda_stream

    C, device, (B, T) = A.ext(), r.device, r.shape
    stream = cuda_stream(r)
    adv, ret = A._outputs(B, T, device)
    status = A._status(device, stream)

    def record():
        a = C.ScanArgs()
        a.kind, a.rewards, a.values, a.mask = A._kinds()[0], r, v, m
        a.advantages, a.returns, a.status = adv, ret, status
        a.gamma, a.lam, a.whiten, a.num_threads, a.stream = 0.99, 0.95, True, torch.get_num_threads(), stream
        return a

    a = record()

    def queue_check():  # the check's pieces of launch_checked, the slot given back
        index, slot = _P.take(device)
        a.host_status = slot
        A._verdict("token_level_rewards", "values", device, "compute_gae")
        _P.release(device, index)

    return [("argument checks (_gae_inputs)", lambda: A._gae_inputs(r, v, m)),
            ("current stream (cuda_stream)", lambda: cuda_stream(r)),
            ("outputs (_outputs)", lambda: A._outputs(B, T, device)),
            ("status record (_status)", lambda: A._status(device, stream)),
            ("record: ScanArgs + 11 fields", record),
            ("launch: _C.advantage_scan", lambda: C.advantage_scan(a)),
            ("check: slot + host_status field", queue_check)]


def logprobs_pieces(logits, labels):
    """logprobs_from_logits' Triton path piece by piece, each as the default call runs it (see
    ops/logprobs.py and kernels/logprobs_from_logits.py): where the host time before the launch goes."""
    from verl_fast.kernels import logprobs_from_logits as K
    from verl_fast.ops import arguments as Vd
    from verl_fast.ops import logprobs as L

    V = logits.shape[-1]
    x, flat = L._as_3d(logits), labels.reshape(-1)
    counter = L._bad_label_counter(logits.device)
    cfg = K.logprobs_config(V)
    out = torch.empty((3, flat.numel()), dtype=torch.float32, device=logits.device)

    def checks():
        L._float_input(logits, "logits")
        Vd.flag(False, "with_entropy"), Vd.flag(True, "check")
        L._labels(labels, logits.shape[:-1], logits.device, "logits' leading dimensions")
        L._inverse_temperature(1.0)
        L._as_3d(logits)

    def launch():  # the Triton JIT's own dispatch and launch, nothing around it
        K._logprobs_fwd_kernel[(flat.numel(),)](x, flat, out[0], out[1], out[2], counter[0], x.shape[1], x.stride(0),
                                                x.stride(1), x.stride(2), V, 1.0, WITH_ENT=False, CHECK=True,
                                                BLOCK_V=cfg.block_v, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)

    return [("argument checks", checks),
            ("label counter (_bad_label_counter)", lambda: L._bad_label_counter(logits.device)),
            ("outputs (one [3, N] allocation)", lambda: torch.empty((3, flat.numel()), dtype=torch.float32,
                                                                    device=logits.device)),
            ("forward without autograd (logprobs_forward)",
             lambda: K.logprobs_forward(x, flat, 1.0, False, bad_labels=counter[0])),
            ("launch: the Triton kernel alone", launch),
            ("autograd entry (logprobs_from_logits_triton)",
             lambda: K.logprobs_from_logits_triton(x, flat, 1.0, False, None, counter[0])),
            ("check: queued label-count copy", lambda: L._queue_label_check(counter, flat, V, logits.device))]


def case_host(rep: Report, device: str) -> None:
    """The wrappers' host cost with 2x8 tensors (the kernels cost next to nothing at that size), on
    the CPU and, given a GPU, on it; compute_gae's and (on a GPU) logprobs_from_logits' pieces one by one."""
    for dev in ["cpu"] + ([device] if device.startswith("cuda") else []):
        torch.manual_seed(0)
        r, v = torch.randn(2, 8, device=dev), torch.randn(2, 8, device=dev)
        m = torch.rand(2, 8, device=dev) < 0.8
        m[:, 0] = True
        case = f"host per call: compute_gae 2x8 {dev}"
        add_host_rows(rep, case, [("default", lambda: vf.compute_gae(r, v, m, 0.99, 0.95)),
                                  ("check=False", lambda: vf.compute_gae(r, v, m, 0.99, 0.95, check=False))], dev)
        add_piece_rows(rep, case, gae_pieces(r, v, m), dev)
        logits = torch.randn(2, 8, 16, device=dev)
        labels = torch.randint(0, 16, (2, 8), device=dev)
        path = "Triton" if dev.startswith("cuda") else "torch"
        case = f"host per call: logprobs_from_logits 2x8x16 {dev} ({path} path)"
        add_host_rows(rep, case, [("default", lambda: vf.logprobs_from_logits(logits, labels)),
                                  ("check=False", lambda: vf.logprobs_from_logits(logits, labels, check=False))], dev)
        if path == "Triton":
            add_piece_rows(rep, case, logprobs_pieces(logits, labels), dev)


# ------------------------------------------------------------------ cases


def case_gae(rep: Report, device: str, bw: float) -> None:
    B, T = (1024, 4096) if device.startswith("cuda") else (64, 256)
    case = f"gae {B}x{T}"
    r, v, m = gae_inputs(B, T, device)
    rep.floors[case] = B * T * (4 + 4 + 1 + 4 + 4) / (bw * 1e9) * 1e3
    ref_adv, _ = loop_gae(r, v, m, 0.99, 0.95)
    adv, _ = vf.compute_gae(r, v, m, 0.99, 0.95)
    rep.meta["gae_max_err"] = (adv - ref_adv).abs().max().item()
    kw = dict(warmup=10, rep=200)
    for label, ctx in STAGES:
        with ctx():
            both_ways(rep, case, f"{label} default", lambda: vf.compute_gae(r, v, m, 0.99, 0.95), device, **kw)
            both_ways(rep, case, f"{label} check=False",
                      lambda: vf.compute_gae(r, v, m, 0.99, 0.95, check=False), device, **kw)
    if device.startswith("cuda"):
        rep.add(case, "graph replay", graph_ms(lambda: vf.compute_gae(r, v, m, 0.99, 0.95, check=False), device),
                note="GPU time alone: the call captured in a CUDA graph")
        calls = 20
        try:  # a diagnostic: a profiler failure costs its rows, not the report
            top = kernel_profile(lambda: [vf.compute_gae(r, v, m, 0.99, 0.95) for _ in range(calls)])["top_kernels"]
        except Exception as e:  # noqa: BLE001
            print(f"gae: the kernel breakdown failed: {type(e).__name__}: {e}", flush=True)
            top = []
        for k in top:  # the memset, the scan, the whitening, the check's copy
            if k["total_ms"] > 0:
                rep.add(case, f"  GPU: {k['name'][:60]}", k["total_ms"] / calls, note="per call, from the profiler")
    rep.add(case, "python loop (verl)", time_ms(lambda: loop_gae(r, v, m, 0.99, 0.95), device, warmup=1, rep=3))


def case_gae_rows(rep: Report, device: str, bw: float) -> None:
    """The scan's GPU time (memset + scan_kernel: whiten=False, check=False, graph replay) over row counts at
    one row length, then over row lengths at one row count. Each row is one chain of steps from its right end:
    where the time stays flat as rows double, a row's chain (latency) bounds it; where it doubles with them,
    the SMs' issue rate or the memory's does."""
    cuda = device.startswith("cuda")
    T0, B0 = (4096, 1024) if cuda else (256, 64)
    shapes = [(b, T0) for b in ((128, 256, 512, 1024, 2048, 4096, 8192) if cuda else (16, 64))]
    shapes += [(B0, t) for t in ((512, 1024, 2048, 8192, 16384) if cuda else (64,))]
    for B, T in shapes:
        r, v, m = gae_inputs(B, T, device)
        fn = lambda: vf.compute_gae(r, v, m, 0.99, 0.95, whiten=False, check=False)  # noqa: E731
        ms = graph_ms(fn, device) if cuda else time_ms(fn, device)
        floor_ms = B * T * 17 / (bw * 1e9) * 1e3
        rep.add("gae_rows scan", f"{B}x{T}", ms,
                note=f"{B * T * 17 / (ms * 1e-3) / 1e9:.0f} GB/s; floor {floor_ms * 1e3:.1f} us; "
                     f"{T / (ms * 1e3) if ms else 0:.0f} positions a row per us")
        del r, v, m


def case_logprobs(rep: Report, device: str, bw: float) -> None:
    cuda = device.startswith("cuda")
    N, Vv = (8192, shape("Qwen2.5-1.5B").vocab_size) if cuda else (256, 4096)
    case = f"logprobs {N}x{Vv} bf16"
    logits = (torch.randn(N, Vv, device=device) * 3).to(torch.bfloat16)
    labels = torch.randint(0, Vv, (N,), device=device)
    rep.floors[case] = logits.numel() * 2 / (bw * 1e9) * 1e3
    kw = dict(warmup=5, rep=50)
    for label, ctx in STAGES:
        with ctx():
            both_ways(rep, case, f"{label} default",
                      lambda: vf.logprobs_from_logits(logits, labels, with_entropy=True), device, **kw)
            both_ways(rep, case, f"{label} check=False",
                      lambda: vf.logprobs_from_logits(logits, labels, with_entropy=True, check=False), device, **kw)
    got = vf.logprobs_from_logits(logits[:256], labels[:256])
    want = torch.log_softmax(logits[:256].double(), -1).gather(-1, labels[:256, None]).squeeze(-1)
    rep.meta["logprobs_max_err"] = (got.double() - want).abs().max().item()

    def naive():
        lp = torch.log_softmax(logits.float(), -1)
        return lp.gather(-1, labels[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)

    rep.add(case, "naive fp32 log_softmax, called", time_ms(naive, device, warmup=2, rep=10))


def case_reshard(rep: Report, device: str, bw: float) -> None:
    from bench_reshard import baseline_cat_alloc, make_spec
    from verl_fast.ops.reshard import hf_layout, vllm_layout, vllm_weights

    spec = make_spec("full" if device.startswith("cuda") else "small")
    src_layout, dst_tensors = hf_layout(spec), vllm_layout(spec, 1).tensors
    g = torch.Generator(device=device).manual_seed(0)
    src = {t.name: torch.randn(t.shape, generator=g, device=device).to(torch.bfloat16) for t in src_layout.tensors}
    case = f"reshard one-shot, {len(src)} tensors"
    moved = 2 * sum(t.numel * t.dtype.itemsize for t in dst_tensors)
    rep.floors[case] = moved / (bw * 1e9) * 1e3
    want = baseline_cat_alloc(dst_tensors, src)
    kw = dict(warmup=3, rep=20)
    rep.add(case, "per-param torch.cat (alloc), called", time_ms(lambda: baseline_cat_alloc(dst_tensors, src), device,
                                                                 **kw))
    for label, ctx in (("before #48", before_48), ("after #48", contextlib.nullcontext)):
        with ctx():
            got = dict(vllm_weights(src, spec, device=device))
            err = max((got[t.name].float() - w.float()).abs().max().item() for t, w in zip(dst_tensors, want))
            rep.add(case, f"{label} vllm_weights, called",
                    time_ms(lambda: dict(vllm_weights(src, spec, device=device)), device, **kw), max_err=err,
                    note="the default: new outputs every call")
    rep.add(case, "vllm_weights reuse=True, called",
            time_ms(lambda: dict(vllm_weights(src, spec, device=device, reuse=True)), device, **kw),
            note="outputs kept and rewritten (a sync loop's choice)")
    rep.meta["reshard_bytes_moved"] = moved


def case_linear(rep: Report, device: str, bw: float, model: str = "Qwen2.5-7B", sweep: bool = True) -> None:
    """The log-prob head at ``model``'s hidden size (the vocabulary of the Qwen2.5 family); ``sweep``:
    the chunk sizes and the Triton d_hidden too."""
    from bench_logprob import reference_linear, rel_err
    from verl_fast.kernels.linear_logprobs import linear_config

    cuda = device.startswith("cuda")
    H = shape(model).hidden_size
    N, H, Vv = (8192, H, shape("Qwen2.5-1.5B").vocab_size) if cuda else (256, max(32, H // 56), 2048)
    dtype = torch.bfloat16 if cuda else torch.float32
    case = f"linear fwd+bwd {N}x{H}x{Vv}"
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(N, H, device=device, generator=gen).to(dtype).requires_grad_(True)
    w = (torch.randn(Vv, H, device=device, generator=gen) * 3 / H**0.5).to(dtype).requires_grad_(True)
    labels = torch.randint(0, Vv, (N,), device=device, generator=gen)
    x, y = h.detach(), w.detach()
    mm = time_ms(lambda: torch.mm(x, y.t()), device, warmup=3, rep=10)
    rep.floors[case] = 3 * mm
    rep.meta.setdefault("linear_gemms", {})[case] = dict(gemm_ms=mm, four_gemm_ms=4 * mm,
                                                         gemm_tflops=2 * N * H * Vv / (mm * 1e-3) / 1e12)
    ref = reference_linear(x, y, labels, -1.0, 0.0) if not cuda else None

    def step(run):
        h.grad = w.grad = None
        run().backward()

    def naive():
        lp = torch.log_softmax((h @ w.t()).float(), -1)
        return -lp.gather(-1, labels[:, None]).sum()

    def add(impl, run, note=""):
        ms = time_ms(lambda: step(run), device, warmup=2, rep=8)
        h.grad = w.grad = None
        extra = peak_extra_bytes(lambda: step(run), device)
        step(run)
        if ref is not None:
            note += f" dH {rel_err(h.grad, ref[2]):.1e} dW {rel_err(w.grad, ref[3]):.1e} (rel to float64)"
        rep.add(case, impl, ms, extra, note=note.strip())

    add("naive matmul+log_softmax", naive)
    if not cuda:
        add("verl_fast default", lambda: -vf.linear_logprobs(h, w, labels, backend="torch").sum())
        cfg = linear_config(N, H, Vv, dtype, h.device, store_logits=True, dhidden_cublas=True)
        add("store_logits (3 GEMMs), Triton interpreter",
            lambda: -vf.linear_logprobs(h, w, labels, backend="triton", config=cfg).sum())
        return
    add("verl_fast default", lambda: -vf.linear_logprobs(h, w, labels).sum())
    for mib in (128, 192, 256) if sweep else ():
        cfg = linear_config(N, H, Vv, dtype, h.device, chunk_bytes=mib << 20)
        add(f"chunk {mib} MiB", lambda cfg=cfg: -vf.linear_logprobs(h, w, labels, config=cfg).sum(),
            "fewer passes of the fp32 d_hidden accumulator (one per chunk)")
    if sweep:
        cfg = linear_config(N, H, Vv, dtype, h.device, dhidden_cublas=False)
        add("d_hidden by Triton", lambda: -vf.linear_logprobs(h, w, labels, config=cfg).sum())
    cfg = linear_config(N, H, Vv, dtype, h.device, store_logits=True)
    add("store_logits (3 GEMMs)", lambda: -vf.linear_logprobs(h, w, labels, config=cfg).sum(),
        "logits kept in bf16 from the forward: N*V*2 bytes more, a plain matmul's rounding")


RUNNERS = {"gae": case_gae, "gae_rows": case_gae_rows, "logprobs": case_logprobs, "reshard": case_reshard,
           "linear": case_linear,
           "linear05": lambda rep, device, bw: case_linear(rep, device, bw, "Qwen2.5-0.5B", sweep=False),
           "host": lambda rep, device, bw: case_host(rep, device)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cases", default=",".join(CASES), help=f"some of {','.join(CASES)}")
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    if not set(cases) <= set(CASES):
        p.error(f"--cases takes some of {','.join(CASES)}, got {args.cases}")
    rep = Report("hotpaths", args.device)
    bw = copy_bandwidth_gbs(args.device)
    rep.meta["copy_bandwidth_GBps"] = bw
    failed = []
    for name in cases:
        t0 = time.monotonic()
        try:
            RUNNERS[name](rep, args.device, bw)
        except Exception:  # one case failing leaves the others' figures
            failed.append(name)
            rep.meta[f"{name}_error"] = traceback.format_exc()[-2000:]
            traceback.print_exc()
        rep.meta[f"{name}_seconds"] = time.monotonic() - t0
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(f"{name}: {rep.meta[f'{name}_seconds']:.1f} s", flush=True)
    path = rep.save()
    print(rep.table())
    print(f"saved {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
