"""Log-prob benchmarks (issue 4): logits -> log-prob (+ entropy), and hidden -> log-prob fused with the lm_head.

    python -m verl_fast.bench.ops_logprob [--device cuda|cpu] [--tokens N] [--hidden H] [--vocab V] [--no-sweep]
                                       [--cases logits,linear]

Cases (defaults: CUDA N=8192, H=3584, V=151936, bf16; CPU: small sizes, the chunked torch path):
  logits fwd (lp+ent)      naive fp32 log_softmax + gather + entropy | ours | floor: read the logits once
  logits fwd+bwd (lp+ent)  the same with the backward              | floor: read twice, write d_logits
  linear fwd+bwd (lp)      matmul + log_softmax | Liger FLCE (if importable) | ours | floor: 3 GEMMs
                           | 3-GEMM bound: chunked cuBLAS GEMMs with the gradient known in the forward
  linear fwd+bwd (lp+ent)  matmul + log_softmax + entropy | ours
GEMM floors use the bf16 matmul rate measured in this run (torch.mm, cuBLAS). On CUDA the Triton
block sizes are swept first, one kernel at a time ("tune: ..." rows), and the fastest are used for
the "verl_fast" rows; "defaults" rows show the built-in choice. Errors are max |logp - ref| against a
float64 reference; gradient errors (relative to the largest entry) are in the notes. Extra memory is
the peak above what was live before the call, counting the gradients a fwd+bwd step allocates.
Logits cases are timed with the GPU kept busy while the host launches (time_ms busy_gpu): their
GPU time, with host overhead hidden as in a training step, except where the op syncs.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from verl_fast.bench.record import Report, copy_bandwidth_gbs, peak_extra_bytes, time_ms
from verl_fast.bench.timing import sync

import verl_fast as vf
from verl_fast.bench.shapes import shape

TUNE_REPS = dict(warmup=3, rep=10)
DEADLINE = [float("inf")]  # time.monotonic() after which sweeps stop trying new candidates


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="log-prob kernels vs baselines")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--cases", default="logits,linear",
                   help="logits, linear or both; a partial run saves bench_logprob_<case>_<device>.json")
    p.add_argument("--no-sweep", action="store_true", help="use the built-in block sizes only")
    p.add_argument("--sweep-seconds", type=float, default=240.0,
                   help="time for the block-size sweeps (compiles included); candidates left are skipped")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    a.tokens = a.tokens or (8192 if cuda else 512)
    # GPU: Qwen2.5-7B's hidden size with the Qwen2.5 vocabulary of the 0.5B-3B models (151936)
    a.hidden = a.hidden or (shape("Qwen2.5-7B").hidden_size if cuda else 256)
    a.vocab = a.vocab or (shape("Qwen2.5-1.5B").vocab_size if cuda else 8192)
    a.dtype = getattr(torch, a.dtype)
    a.sweep = cuda and not a.no_sweep
    a.cases = a.cases.split(",")
    if not a.cases or not set(a.cases) <= {"logits", "linear"}:
        p.error(f"--cases takes logits, linear or logits,linear; got {','.join(a.cases)}")
    return a


# ------------------------------------------------------------------ float64 references


def reference_logits(logits, labels, rows: int = 256):
    """(logp, entropy) in float64, a few rows at a time."""
    logp, ent = [], []
    for r in range(0, logits.shape[0], rows):
        lp = torch.log_softmax(logits[r : r + rows].double(), -1)
        logp.append(lp.gather(-1, labels[r : r + rows, None]).squeeze(-1))
        ent.append(-(lp.exp() * lp).sum(-1))
    return torch.cat(logp), torch.cat(ent)


def reference_linear(h, w, labels, g_lp: float, g_ent: float, rows: int = 512):
    """(logp, entropy, d_hidden, d_weight) in float64 for loss = sum(g_lp * logp + g_ent * entropy)."""
    h64, w64 = h.double(), w.double()
    d_w = torch.zeros_like(w64)
    out = []
    for r in range(0, h.shape[0], rows):
        lp = torch.log_softmax(h64[r : r + rows] @ w64.t(), -1)
        p = lp.exp()
        ent = -(p * lp).sum(-1)
        logp = lp.gather(-1, labels[r : r + rows, None]).squeeze(-1)
        dz = -p * (g_lp + g_ent * (lp + ent[:, None]))
        dz.scatter_add_(1, labels[r : r + rows, None], torch.full_like(logp[:, None], g_lp))
        out.append((logp, ent, dz @ w64))
        d_w += dz.t() @ h64[r : r + rows]
        del lp, p, dz
    logp, ent, d_h = (torch.cat(x) for x in zip(*out))
    return logp, ent, d_h, d_w


def rel_err(a, ref) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------ logits -> log-prob


def bench_logits(rep: Report, a, bw_gbs: float, lp_cfg) -> None:
    dev = a.device
    logits = (torch.randn(a.tokens, a.vocab, device=dev) * 3).to(a.dtype)
    labels = torch.randint(0, a.vocab, (a.tokens,), device=dev)
    r_logp, r_ent = reference_logits(logits, labels)
    nbytes = logits.numel() * logits.element_size()
    case_f, case_b = "logits fwd (lp+ent)", "logits fwd+bwd (lp+ent)"
    rep.floors[case_f] = nbytes / (bw_gbs * 1e9) * 1e3
    rep.floors[case_b] = 3 * nbytes / (bw_gbs * 1e9) * 1e3

    def naive(x):
        lp = torch.log_softmax(x.float(), -1)
        return lp.gather(-1, labels[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)

    ours_kw = dict(backend="torch") if dev == "cpu" else dict(config=lp_cfg)
    impls = [("naive fp32 log_softmax", naive, "")]
    if dev != "cpu":
        impls.append(("defaults", lambda x: vf.logprobs_from_logits(x, labels, with_entropy=True), ""))
    impls.append(("verl_fast", lambda x: vf.logprobs_from_logits(x, labels, with_entropy=True, **ours_kw),
                  "chunked torch" if dev == "cpu" else str(lp_cfg)))
    if dev != "cpu":  # without the label-range check's device-to-host read (a host sync)
        impls.append(("verl_fast check=False",
                      lambda x: vf.logprobs_from_logits(x, labels, with_entropy=True, check=False, **ours_kw),
                      "no label check read-back"))
    g = torch.randn(a.tokens, device=dev)
    x = logits.detach().requires_grad_(True)
    for name, fn, note in impls:
        logp, ent = fn(logits)
        err = max((logp.double() - r_logp).abs().max().item(), (ent.double() - r_ent).abs().max().item())
        rep.add(case_f, name, time_ms(lambda: fn(logits), dev, busy_gpu=True), peak_extra_bytes(lambda: fn(logits), dev),
                err, note)

        def step(fn=fn):
            x.grad = None
            logp, ent = fn(x)
            (logp * g + 0.01 * ent).sum().backward()

        ms = time_ms(step, dev, busy_gpu=True)
        x.grad = None  # so the peak counts the d_logits the step allocates
        rep.add(case_b, name, ms, peak_extra_bytes(step, dev), err, note)
        x.grad = None


# ------------------------------------------------------------------ hidden -> log-prob


def linear_inputs(a):
    gen = torch.Generator(device=a.device).manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, device=a.device, generator=gen).to(a.dtype)
    # std 3 / sqrt(H): logits of std ~3, a peaked-but-not-one-hot softmax like a trained head's
    w = (torch.randn(a.vocab, a.hidden, device=a.device, generator=gen) * 3 / a.hidden**0.5).to(a.dtype)
    labels = torch.randint(0, a.vocab, (a.tokens,), device=a.device, generator=gen)
    return h.requires_grad_(True), w.requires_grad_(True), labels


def _liger():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception:  # not installed, or it needs what this machine lacks
        return None
    return liger_fused_linear_cross_entropy


def three_gemm_bound(h, w, chunk: int):
    """What a scheme that knows the upstream gradient in the forward (Liger's FLCE; linear_logprobs
    cannot: its callers' losses come after it) would at least cost: per chunk of tokens, the logits
    GEMM (kept in bf16), one reduction and one in-place pass standing in for the softmax statistics
    and d_logits (no real softmax), then the d_hidden and (accumulated) d_weight GEMMs."""
    d_w = torch.zeros_like(w)
    d_h = torch.empty_like(h)
    for c0 in range(0, h.shape[0], chunk):
        hc = h[c0 : c0 + chunk]
        z = torch.mm(hc, w.t())
        z.sub_(z.amax(-1, keepdim=True))
        torch.mm(z, w, out=d_h[c0 : c0 + chunk])
        d_w.addmm_(z.t(), hc)
    return d_h, d_w


def bench_three_gemm_bound(rep: Report, a, h, w) -> None:
    h, w = h.detach(), w.detach()
    for chunk in (512, 2048):
        run = lambda: three_gemm_bound(h, w, chunk)  # noqa: E731
        rep.add("linear fwd+bwd (lp)", f"3-GEMM bound, {chunk}-token chunks", time_ms(run, a.device),
                peak_extra_bytes(run, a.device), note="gradient known in forward; stand-in elementwise passes")


def bench_linear(rep: Report, a, mm_ms: float, cfg) -> None:
    h, w, labels = linear_inputs(a)
    rep.floors["linear fwd+bwd (lp)"] = 3 * mm_ms
    if a.device != "cpu":
        bench_three_gemm_bound(rep, a, h, w)
    ours_kw = dict(backend="torch") if a.device == "cpu" else dict(config=cfg)
    liger = _liger() if a.device != "cpu" else None
    for with_ent, g_ent in ((False, 0.0), (True, 0.01)):
        case = f"linear fwd+bwd (lp{'+ent' if with_ent else ''})"
        ref = reference_linear(h.detach(), w.detach(), labels, -1.0, g_ent)

        def naive():  # (logp, loss)
            lp = torch.log_softmax((h @ w.t()).float(), -1)
            logp = lp.gather(-1, labels[:, None]).squeeze(-1)
            return logp, -logp.sum() + (g_ent * -(lp.exp() * lp).sum() if with_ent else 0)

        def ours(**kw):
            out = vf.linear_logprobs(h, w, labels, with_entropy=with_ent, **kw)
            logp, ent = out if with_ent else (out, None)
            return logp, -logp.sum() + (g_ent * ent.sum() if with_ent else 0)

        # (name, run -> (logp or None, loss), logp for the error check, note)
        impls = [("naive matmul+log_softmax", naive, None, "")]
        if liger is not None and not with_ent:
            impls.append(("liger FLCE", lambda: (None, liger(h, w, labels, reduction="sum")),
                          lambda: -liger(h, w, labels, reduction="none"), "loss = -sum logp"))
        if a.device != "cpu":
            impls.append(("defaults", ours, None, ""))
        impls.append(("verl_fast", lambda: ours(**ours_kw), None, "chunked torch" if a.device == "cpu" else "tuned"))
        for name, run, logp_fn, note in impls:
            _add_linear(rep, case, name, run, logp_fn or (lambda run=run: run()[0]), h, w, ref, a.device, note)
        del ref


def _add_linear(rep: Report, case: str, name: str, run, logp_fn, h, w, ref, dev: str, note: str) -> None:
    r_logp, _, r_dh, r_dw = ref

    def step():
        h.grad = w.grad = None
        run()[1].backward()

    ms = time_ms(step, dev)
    h.grad = w.grad = None  # so the peak counts the gradients the step allocates
    extra = peak_extra_bytes(step, dev)
    step()
    with torch.no_grad():
        err = (logp_fn().double() - r_logp).abs().max().item()
    grads = f"dH {rel_err(h.grad, r_dh):.1e} dW {rel_err(w.grad, r_dw):.1e} (rel)"
    rep.add(case, name, ms, extra, err, f"{note}; {grads}" if note else grads)
    h.grad = w.grad = None


# ------------------------------------------------------------------ block-size sweeps (CUDA)


def _tiles_label(t) -> str:
    return f"{t.block_m}x{t.block_n}x{t.block_k} g{t.group_m} w{t.num_warps} s{t.num_stages}{' tma' if t.tma else ''}"


def _pick(rep: Report, case: str, candidates, label: Callable, time_one: Callable):
    """Times each candidate (compile errors and out-of-resource configs are noted, not fatal); the
    first candidate is always tried, the others only while the sweep's deadline allows."""
    timed = []
    for i, c in enumerate(candidates):
        if i and time.monotonic() > DEADLINE[0]:
            rep.add(case, label(c), float("nan"), note="skipped: sweep time used up")
            continue
        try:
            ms = time_one(c)
        except Exception as e:  # a config this device or Triton version cannot take
            rep.add(case, label(c), float("nan"), note=f"failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        rep.add(case, label(c), ms)
        timed.append((ms, len(timed), c))
    if not timed:
        raise RuntimeError(f"{case}: no candidate ran")
    return min(timed, key=lambda x: x[:2])[2]


def sweep_logits(rep: Report, a):
    from verl_fast.kernels.logprobs_from_logits import logprobs_config, logprobs_forward

    x = torch.randn(1, a.tokens, a.vocab, device=a.device).to(a.dtype)
    labels = torch.randint(0, a.vocab, (a.tokens,), device=a.device)
    cands = [logprobs_config(a.vocab, bv, nw, ns) for bv in (2048, 4096, 1024, 8192) for nw in (4, 2, 8)
             for ns in (3, 4, 2)]
    return _pick(rep, "tune: logits fwd", cands, lambda c: f"block_v {c.block_v} w{c.num_warps} s{c.num_stages}",
                 lambda c: time_ms(lambda: logprobs_forward(x, labels, 1.0, True, config=c), a.device, busy_gpu=True,
                                   **TUNE_REPS))


# (block_m, block_n, block_k, group_m, num_warps, num_stages[, tma]); the dhidden GEMM also tries cuBLAS.
# Most promising first: a sweep cut short by --sweep-seconds still tries these.
GEMM_TILES = [(128, 256, 64, 16, 8, 3), (128, 256, 64, 16, 8, 3, True), (128, 256, 64, 16, 8, 4),
              (128, 256, 64, 16, 8, 4, True), (128, 256, 64, 8, 8, 3), (128, 256, 64, 32, 8, 3),
              (128, 128, 64, 16, 8, 4), (128, 128, 64, 16, 8, 4, True), (128, 128, 64, 16, 4, 4), (256, 128, 64, 16, 8, 3)]
DHIDDEN_TILES = [(128, 256, 64, 16, 8, 3), (128, 128, 64, 16, 8, 4), (256, 128, 64, 16, 8, 3)]


def sweep_linear(rep: Report, a):
    from verl_fast.kernels import linear_logprobs as L
    from verl_fast.kernels.softmax_stats import finalize, merge

    h, w, labels = (t.detach() for t in linear_inputs(a))
    N, H, V = a.tokens, a.hidden, a.vocab
    conf = lambda **kw: L.linear_config(N, H, V, a.dtype, a.device, **kw)  # noqa: E731
    tiles = [L.Tiles(*t) for t in GEMM_TILES]
    fwd = _pick(rep, "tune: linear fwd", tiles, _tiles_label, lambda t: time_ms(
        lambda: L.linear_logprobs_forward(h, w, None, labels, 1.0, 0, True, config=conf(forward=t)), a.device,
        **TUNE_REPS))
    lse, _, ent = finalize(merge(L.linear_logprobs_forward(h, w, None, labels, 1.0, 0, True, config=conf())))
    g = torch.randn(2, N, device=a.device)
    dlogits = _pick(rep, "tune: linear bwd dlogits", tiles, _tiles_label, lambda t: time_ms(
        lambda: L.linear_logprobs_backward(h, w, None, labels, lse, ent, g[0], g[1], 1.0, 0, (False, False, False),
                                           config=conf(dlogits=t)), a.device, **TUNE_REPS))
    base = conf()
    width = L.chunk_width(base, N, V, h.element_size())
    buf = torch.randn(N, width, device=a.device).to(a.dtype) * 1e-3
    d_h = torch.zeros(N, H, device=a.device)

    def dhidden(choice):
        cfg = conf(dhidden=None if choice == "cublas" else choice, dhidden_cublas=choice == "cublas")
        if choice == "cublas" and not (a.dtype == torch.float32 or L.cublas_accumulates_in_fp32(h.device)):
            raise RuntimeError("torch.addmm(out_dtype=float32) is not available here")
        return time_ms(lambda: [L.accumulate_dhidden(d_h, buf[:, : min(V, v0 + width) - v0], w[v0 : v0 + width],
                                                      cfg, choice == "cublas") for v0 in range(0, V, width)],
                       a.device, **TUNE_REPS)

    best_dh = _pick(rep, "tune: linear bwd dhidden", ["cublas"] + [L.Tiles(*t) for t in DHIDDEN_TILES],
                    lambda c: "cuBLAS addmm fp32 out" if c == "cublas" else _tiles_label(c), dhidden)
    cfg = conf(forward=fwd, dlogits=dlogits, dhidden=None if best_dh == "cublas" else best_dh,
               dhidden_cublas=best_dh == "cublas")
    rep.meta["linear_config"] = repr(cfg)
    return cfg


# ------------------------------------------------------------------ main


def matmul_ms(a) -> float:
    x = torch.randn(a.tokens, a.hidden, device=a.device).to(a.dtype)
    y = torch.randn(a.vocab, a.hidden, device=a.device).to(a.dtype)
    return time_ms(lambda: torch.mm(x, y.t()), a.device)


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.manual_seed(0)
    rep = Report("bench_logprob" if len(a.cases) == 2 else f"bench_logprob_{a.cases[0]}", a.device)
    rep.meta.update(tokens=a.tokens, hidden=a.hidden, vocab=a.vocab, dtype=str(a.dtype))
    bw = copy_bandwidth_gbs(a.device)
    mm = matmul_ms(a)
    gemm_tflops = 2 * a.tokens * a.hidden * a.vocab / (mm * 1e-3) / 1e12
    rep.meta.update(bandwidth_gbs=bw, matmul_ms=mm, matmul_tflops=gemm_tflops, four_gemm_floor_ms=4 * mm)
    DEADLINE[0] = time.monotonic() + a.sweep_seconds
    if "logits" in a.cases:
        lp_cfg = sweep_logits(rep, a) if a.sweep else None
        rep.meta["logprobs_config"] = repr(lp_cfg)
        bench_logits(rep, a, bw, lp_cfg)
        sync(a.device)
    if "linear" in a.cases:
        bench_linear(rep, a, mm, sweep_linear(rep, a) if a.sweep else None)
    table = rep.table()
    table += (f"\nmeasured: copy {bw:.0f} GB/s, one {a.tokens}x{a.hidden}x{a.vocab} GEMM {mm:.2f} ms "
              f"({gemm_tflops:.0f} TFLOP/s); exact recompute needs 4 GEMMs: {4 * mm:.1f} ms")
    print(table)
    for r in rep.rows:
        if r.note and not r.case.startswith("tune"):
            print(f"  {r.case} / {r.impl}: {r.note}")
    path = rep.save()
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
