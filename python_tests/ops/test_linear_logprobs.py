"""linear_logprobs (fused lm_head + log-prob + entropy) against a float64 reference, including the
vocabulary-parallel form with gloo world size 2."""

import os
import socket
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

import verl_fast as vf
from logprob_refs import BACKENDS, DTYPES, assert_grad, assert_values, reference
from verl_fast.kernels.autograd import LinearLogprobsFunction
from verl_fast.ops import _logprobs_torch


def make_inputs(N, H, V, dtype, device, with_bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype).to(device)
    weight = (torch.randn(V, H, generator=gen) * 2 / H**0.5).to(dtype).to(device)
    bias = torch.randn(V, generator=gen).to(dtype).to(device) if with_bias else None
    labels = torch.randint(0, V, (N,), generator=gen).to(device)
    g = torch.randn(2, N, generator=gen).to(device)
    return hidden, weight, bias, labels, g


def ours(hidden, weight, bias, labels, g, temperature, backend, **kw):
    """(logp, entropy, d_hidden, d_weight, d_bias) for loss = sum(g0 * logp + g1 * entropy)."""
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    logp, ent = vf.linear_logprobs(leaves[0], leaves[1], labels, temperature, True, bias=leaves[2],
                                   backend=backend, **kw)
    (logp * g[0] + ent * g[1]).sum().backward()
    return logp, ent, *[t.grad if t is not None else None for t in leaves]


def expected(hidden, weight, bias, labels, g, temperature):
    # float64 on the inputs' device (a GPU's fp64 GEMMs keep the large cases quick)
    leaves = [t.detach().double().requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    z = leaves[0] @ leaves[1].t() + (leaves[2] if bias is not None else 0)
    logp, ent = reference(z / temperature, labels)
    (logp * g[0] + ent * g[1]).sum().backward()
    return logp, ent, *[t.grad if t is not None else None for t in leaves]


def check(got, want, dtype, what=""):
    names = ("logp", "entropy", "d_hidden", "d_weight", "d_bias")
    for name, a, b in zip(names, got, want):
        if name in ("logp", "entropy"):
            assert_values(a.reshape(b.shape), b, name + what)
        elif b is not None:
            assert_grad(a.reshape(b.shape), b, dtype, name + what)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H,V,with_bias", [(1, 16, 33, False), (37, 40, 300, True), (5, 24, 129, False)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference(backend, dtype, N, H, V, with_bias, temperature):
    inputs = make_inputs(N, H, V, dtype, backend[0], with_bias)
    check(ours(*inputs, temperature, backend[1]), expected(*inputs, temperature), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_chunks_and_vocabulary_splits(backend, monkeypatch):
    """Force several backward chunks and forward splits (Triton) / vocabulary chunks (torch)."""
    N, H, V = 20, 32, 700
    inputs = make_inputs(N, H, V, torch.float32, backend[0], True, seed=1)
    kw = {}
    if backend[1] == "triton":
        from verl_fast.kernels.linear_logprobs import linear_config

        kw["config"] = linear_config(N, H, V, torch.float32, backend[0], chunk_bytes=N * 4 * 128,
                                     stats_bytes=16 * N * 3, dhidden_cublas=backend[0] == "cpu")
    else:
        monkeypatch.setattr(_logprobs_torch, "CHUNK_ELEMENTS", N * 128)
    check(ours(*inputs, 0.9, backend[1], **kw), expected(*inputs, 0.9), torch.float32)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0][1] == "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [40, 33])  # 33 bf16: rows of 66 bytes, which TMA cannot address -> plain loads
def test_tma_tiles(backend, dtype, H):
    from verl_fast.kernels.linear_logprobs import Tiles, linear_config

    N, V = 45, 300
    tiles = Tiles(32, 64, 32, 4, 4, 2, tma=True) if backend[0] == "cpu" else Tiles(128, 128, 64, 8, 8, 3, tma=True)
    cfg = linear_config(N, H, V, dtype, backend[0], forward=tiles, dlogits=tiles)
    inputs = make_inputs(N, H, V, dtype, backend[0], True, seed=9)
    check(ours(*inputs, 0.8, "triton", config=cfg), expected(*inputs, 0.8), dtype)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(N=st.integers(1, 9), H=st.integers(1, 20), V=st.integers(1, 90), with_bias=st.booleans(),
       temperature=st.floats(0.3, 3.0), chunk=st.integers(1, 400), seed=st.integers(0, 2**16))
def test_chunked_torch_path_hypothesis(N, H, V, with_bias, temperature, chunk, seed):
    inputs = make_inputs(N, H, V, torch.float32, "cpu", with_bias, seed=seed)
    with mock.patch.object(_logprobs_torch, "CHUNK_ELEMENTS", chunk):
        got = ours(*inputs, temperature, "torch")
    check(got, expected(*inputs, temperature), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_magnitude_logits(backend):
    hidden, weight, bias, labels, g = make_inputs(6, 32, 200, torch.float32, backend[0], True, seed=2)
    hidden = hidden * 300  # logits of order 1e3
    got = ours(hidden, weight, bias, labels, g, 1.0, backend[1])
    want = expected(hidden, weight, bias, labels, g, 1.0)
    assert all(torch.isfinite(t).all() for t in got)
    for name, a, b in zip(("logp", "entropy"), got, want):
        assert_values(a, b, name, atol=2e-3)
    for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), got[2:], want[2:]):
        assert_grad(a, b, torch.float32, name, rtol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs_and_leading_dims(backend):
    dev = backend[0]
    torch.manual_seed(3)
    states = torch.randn(2, 9, 24, device=dev, dtype=torch.bfloat16)
    hidden = states[:, 3:-1]  # [2, 5, 24], as sliced from a model's last hidden states
    weight = torch.randn(24, 150, device=dev, dtype=torch.bfloat16).t()  # [150, 24], column-major
    labels = torch.randint(0, 150, (2, 5), device=dev)
    g = torch.randn(2, 2, 5, device=dev)
    got = ours(hidden, weight, None, labels, g, 1.1, backend[1])
    assert got[0].shape == (2, 5) and got[2].shape == (2, 5, 24)
    want = expected(hidden.reshape(10, 24), weight, None, labels.reshape(10), g.reshape(2, 10), 1.1)
    check(got, want, torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_to_one_input_only(backend):
    hidden, weight, _, labels, g = make_inputs(7, 16, 90, torch.float32, backend[0], False, seed=4)
    want = expected(hidden, weight, None, labels, g, 1.0)
    for which in (0, 1):
        leaves = [hidden.clone(), weight.clone()]
        leaves[which].requires_grad_(True)
        logp, ent = vf.linear_logprobs(*leaves, labels, with_entropy=True, backend=backend[1])
        (logp * g[0] + ent * g[1]).sum().backward()
        assert leaves[1 - which].grad is None
        assert_grad(leaves[which].grad, want[2 + which], torch.float32, ("d_hidden", "d_weight")[which])


@pytest.mark.parametrize("backend", BACKENDS)
def test_logp_only_and_empty_batch(backend):
    hidden, weight, _, labels, g = make_inputs(9, 16, 50, torch.float32, backend[0], False, seed=5)
    h = hidden.clone().requires_grad_(True)
    logp = vf.linear_logprobs(h, weight, labels, 0.8, backend=backend[1])
    (logp * g[0]).sum().backward()
    h64 = hidden.cpu().double().requires_grad_(True)
    r_logp, _ = reference(h64 @ weight.cpu().double().t() / 0.8, labels.cpu())
    (r_logp * g[0].cpu()).sum().backward()
    assert_values(logp, r_logp, "logp")
    assert_grad(h.grad, h64.grad, torch.float32, "d_hidden")
    h0 = torch.zeros(0, 16, device=backend[0], requires_grad=True)
    w0 = weight.clone().requires_grad_(True)
    logp, ent = vf.linear_logprobs(h0, w0, labels[:0], with_entropy=True, backend=backend[1])
    assert logp.shape == (0,) and ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert h0.grad.shape == (0, 16) and not w0.grad.any()


TRITON = [b for b in BACKENDS if b.values[0][1] == "triton"]


def _store_config(N, H, V, dtype, device):
    from verl_fast.kernels.linear_logprobs import linear_config

    # d_hidden by torch (not the Triton kernel, slow under the interpreter) where CPU torch can: fp32
    return linear_config(N, H, V, dtype, device, store_logits=True,
                         dhidden_cublas=True if device == "cpu" and dtype == torch.float32 else None)


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("N,H,V,with_bias", [(1, 16, 33, False), (37, 40, 300, True), (5, 24, 2100, True)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_store_logits_float32_matches_reference(backend, N, H, V, with_bias, temperature):
    """Logits kept from the forward (3 GEMMs): exact in float32, so the usual tolerances."""
    inputs = make_inputs(N, H, V, torch.float32, backend[0], with_bias, seed=11)
    cfg = _store_config(N, H, V, torch.float32, backend[0])
    check(ours(*inputs, temperature, "triton", config=cfg), expected(*inputs, temperature), torch.float32)


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_logits_16bit_no_worse_than_a_plain_matmul(backend, dtype):
    """In 16 bits the kept logits are rounded once, as matmul + log_softmax rounds them: every output's
    error against float64 stays within 2x of that plain path's (computed here in fp32 from the same
    16-bit logits; the gradients are rounded to 16 bits in another order) plus float32 rounding."""
    N, H, V = 29, 48, 520
    inputs = make_inputs(N, H, V, dtype, backend[0], True, seed=12)
    hidden, weight, bias, labels, g = inputs
    got = ours(*inputs, 0.9, "triton", config=_store_config(N, H, V, dtype, backend[0]))
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    z = (torch.addmm(leaves[2], leaves[0], leaves[1].t()).float() / 0.9)
    lp = torch.log_softmax(z, -1)
    plain = [lp.gather(-1, labels[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)]
    (plain[0] * g[0] + plain[1] * g[1]).sum().backward()
    plain += [t.grad for t in leaves]
    want = expected(*inputs, 0.9)
    for name, a, b, w in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), got, plain, want):
        err = (a.double().cpu() - w.cpu()).abs().max().item()
        bound = 2 * (b.double().cpu() - w.cpu()).abs().max().item() + 1e-5 * max(w.abs().max().item(), 1)
        assert err <= bound, f"{name}: error {err:.3g} against float64, the plain path's bound {bound:.3g}"


@pytest.mark.parametrize("backend", TRITON)
def test_store_logits_gradients_to_some_inputs_empty_batch_and_one_backward(backend):
    hidden, weight, bias, labels, g = make_inputs(8, 16, 70, torch.float32, backend[0], True, seed=13)
    cfg = _store_config(8, 16, 70, torch.float32, backend[0])
    want = expected(hidden, weight, bias, labels, g, 1.0)
    w = weight.clone().requires_grad_(True)
    logp = vf.linear_logprobs(hidden, w, labels, bias=bias, config=cfg, backend="triton")
    (logp * g[0]).sum().backward(retain_graph=True)
    h64, w64 = hidden.cpu().double(), weight.cpu().double().requires_grad_(True)
    r_logp, _ = reference(h64 @ w64.t() + bias.cpu().double(), labels.cpu())
    (r_logp * g[0].cpu()).sum().backward()
    assert_grad(w.grad, w64.grad, torch.float32, "d_weight")
    with pytest.raises(RuntimeError, match="its backward ran twice"):
        (logp * g[0]).sum().backward()
    h0 = torch.zeros(0, 16, device=backend[0], requires_grad=True)
    w0 = weight.clone().requires_grad_(True)
    cfg0 = _store_config(0, 16, 70, torch.float32, backend[0])
    logp, ent = vf.linear_logprobs(h0, w0, labels[:0], with_entropy=True, config=cfg0, backend="triton")
    (logp.sum() + ent.sum()).backward()
    assert h0.grad.shape == (0, 16) and not w0.grad.any()
    with torch.no_grad():  # inference: nothing kept past the call
        logp = vf.linear_logprobs(hidden, weight, labels, bias=bias, config=cfg, backend="triton")
    assert_values(logp, want[0], "logp")


def test_bad_inputs_name_the_argument():
    h, w = torch.randn(3, 8), torch.randn(20, 8)
    labels = torch.tensor([0, 5, 19])
    f = vf.linear_logprobs
    cases = [
        (lambda: f(h, w[:, :7], labels), ValueError, r"weight must be \[V, H\] with V >= 1 and H = hidden.shape\[-1\] = 8"),
        (lambda: f(h, w[0], labels), ValueError, "weight must be"),
        (lambda: f(h, w.half(), labels), TypeError, "weight must match hidden's dtype"),
        (lambda: f(h.double(), w.double(), labels), TypeError, "hidden must be float32"),
        (lambda: f(h, w, labels, bias=torch.randn(19)), ValueError, r"bias must be \[V\] = \[20\]"),
        (lambda: f(h, w, labels, bias=torch.randn(20).half()), ValueError, "bias must be"),
        (lambda: f(h, w, labels[:2]), ValueError, r"labels must have shape \[3\]"),
        (lambda: f(h, w, labels + 1), ValueError, r"labels must lie in \[0, V\) = \[0, 20\)"),
        (lambda: f(h, w, labels, temperature=0), ValueError, "temperature"),
    ]
    for call, err, msg in cases:
        with pytest.raises(err, match=msg):
            call()


def test_block_size_helper_names_what_it_cannot_handle():
    from verl_fast.kernels.linear_logprobs import Tiles, _fit, linear_config
    from verl_fast.kernels.logprobs_from_logits import logprobs_config

    with pytest.raises(ValueError, match="V=2147483648"):
        linear_config(8, 16, 2**31, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=r"forward.block_m=96 must be a power of two"):
        linear_config(8, 16, 64, torch.bfloat16, "cpu", forward=Tiles(96, 64, 32))
    with pytest.raises(ValueError, match=r"dhidden tiles .* need 262144 bytes of shared memory .* has 232448"):
        _fit(Tiles(256, 256, 64, num_stages=4), "dhidden", 8192, 3584, 151936, 2, 232448, explicit=True)
    auto = _fit(Tiles(128, 256, 64, num_stages=4), "forward", 8192, 151936, 3584, 4, 232448, explicit=False)
    assert auto.smem_bytes(4) <= 232448  # defaults shrink to fit (fp32 here)
    small = linear_config(1, 24, 33, torch.float32, "cpu")
    assert (small.forward.block_m, small.forward.block_n, small.forward.block_k) == (16, 64, 32)
    with pytest.raises(ValueError, match="block_v=100"):
        logprobs_config(1000, block_v=100)
    with pytest.raises(ValueError, match="V=0"):
        logprobs_config(0)


# ------------------------------------------------------------------ tensor parallel (gloo, 2 ranks)

TP = dict(N=11, H=24, V=2 * 70, temperature=0.9)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank, world, port, out_dir, backends):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        hidden, weight, bias, labels, g = make_inputs(TP["N"], TP["H"], TP["V"], torch.float32, "cpu", True, seed=6)
        shard = slice(rank * TP["V"] // world, (rank + 1) * TP["V"] // world)
        results = {}
        for backend in backends:
            kw = {}
            if backend == "triton-store":  # the logits kept from the forward (LinearConfig.store_logits)
                from verl_fast.kernels.linear_logprobs import linear_config

                kw["config"] = linear_config(TP["N"], TP["H"], TP["V"] // world, torch.float32, "cpu",
                                             store_logits=True)
            results[backend] = ours(hidden, weight[shard], bias[shard], labels, g, TP["temperature"],
                                    backend.removesuffix("-store"), tp_group=dist.group.WORLD, **kw)
        try:  # labels are global ids: one past the last shard is out of range (raised before any collective)
            vf.linear_logprobs(hidden, weight[shard], torch.full_like(labels, TP["V"]), tp_group=dist.group.WORLD)
        except ValueError as e:
            results["bad_label_error"] = str(e)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_gloo_world_size_2():
    backends = ["torch"] + (["triton", "triton-store"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_tp_worker, args=(2, _free_port(), out_dir, backends), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    inputs = make_inputs(TP["N"], TP["H"], TP["V"], torch.float32, "cpu", True, seed=6)
    want = expected(*inputs, TP["temperature"])
    for res in ranks:
        assert "[0, 140)" in res.get("bad_label_error", ""), res.get("bad_label_error")
    for backend in backends:
        for rank, res in enumerate(ranks):
            logp, ent, d_hidden = res[backend][:3]
            check((logp, ent, d_hidden), want[:3], torch.float32, f" ({backend}, rank {rank})")
        d_weight = torch.cat([res[backend][3] for res in ranks])
        d_bias = torch.cat([res[backend][4] for res in ranks])
        assert_grad(d_weight, want[3], torch.float32, f"d_weight shards ({backend})")
        assert_grad(d_bias, want[4], torch.float32, f"d_bias shards ({backend})")


# ------------------------------------------------------------------ GPU, full sizes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H,V", [(1, 3584, 151936), (1000, 1024, 32000), (1024, 3584, 151936), (300, 4096, 128256)])
def test_cuda_matches_reference_at_scale(dtype, N, H, V):
    inputs = make_inputs(N, H, V, dtype, "cuda", False, seed=7)
    got = ours(*inputs, 0.8, "triton")
    check(got, expected(*inputs, 0.8), dtype)
    torch_path = ours(*inputs, 0.8, "torch")
    for a, b in zip(got[:2], torch_path[:2]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_bias_and_function_directly():
    inputs = make_inputs(333, 512, 5000, torch.bfloat16, "cuda", True, seed=8)
    check(ours(*inputs, 1.0, "triton"), expected(*inputs, 1.0), torch.bfloat16)
    h, w, b, labels, _ = inputs
    logp, _ = LinearLogprobsFunction.apply(h, w, b, labels, 1.0, False, None, _logprobs_torch.LINEAR)
    torch.testing.assert_close(vf.linear_logprobs(h, w, labels, bias=b), logp, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_peak_memory_within_budget():
    """The benchmark's shape: fwd + bwd peak (including the gradients themselves) <= 1.2 GiB."""
    N, H, V = 8192, 3584, 151936
    hidden = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(True)
    labels = torch.randint(0, V, (N,), device="cuda")

    def step():
        hidden.grad = weight.grad = None
        logp, ent = vf.linear_logprobs(hidden, weight, labels, with_entropy=True)
        (logp.sum() + 0.01 * ent.sum()).backward()

    step()
    torch.cuda.synchronize()
    hidden.grad = weight.grad = None
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= 1.2 * 2**30, f"peak extra memory {peak / 2**30:.3f} GiB > 1.2 GiB"
