"""logprobs_from_logits against a float64 log_softmax + gather reference (values and gradients)."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import verl_fast as vf
from logprob_refs import BACKENDS, DTYPES, assert_grad, assert_values, reference
from verl_fast.ops import _logprobs_torch


def run(logits, labels, temperature, backend, with_entropy=True, seed=0, **kw):
    """Our op and the float64 reference on the same inputs: values, d_logits for random upstream grads."""
    device, name = backend
    gen = torch.Generator().manual_seed(seed)
    g_logp = torch.randn(labels.shape, generator=gen).to(device)
    g_ent = torch.randn(labels.shape, generator=gen).to(device)
    x = logits.detach().requires_grad_(True)
    out = vf.logprobs_from_logits(x, labels, temperature, with_entropy, backend=name, **kw)
    logp, entropy = out if with_entropy else (out, None)
    loss = (logp * g_logp).sum() + ((entropy * g_ent).sum() if with_entropy else 0)
    loss.backward()
    x64 = logits.detach().double().requires_grad_(True)  # on the inputs' device
    r_logp, r_ent = reference(x64 / temperature, labels)
    (r_logp * g_logp + (r_ent * g_ent if with_entropy else 0)).sum().backward()
    return (logp, entropy, x.grad), (r_logp, r_ent, x64.grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (2, 5, 300), (13, 1000)], ids=["N1", "V300-3d", "V1000"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference(backend, dtype, shape, temperature):
    torch.manual_seed(1)
    logits = (torch.randn(shape) * 4).to(dtype).to(backend[0])
    labels = torch.randint(0, shape[-1], shape[:-1], device=backend[0])
    (logp, ent, grad), (r_logp, r_ent, r_grad) = run(logits, labels, temperature, backend)
    assert logp.shape == labels.shape and ent.shape == labels.shape
    assert_values(logp, r_logp, "logp")
    assert_values(ent, r_ent, "entropy")
    assert_grad(grad, r_grad, dtype, "d_logits")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_logp_only_and_one_output_used(backend, with_entropy):
    torch.manual_seed(2)
    logits = torch.randn(6, 77, device=backend[0])
    labels = torch.randint(0, 77, (6,), device=backend[0])
    (logp, _, grad), (r_logp, _, r_grad) = run(logits, labels, 1.3, backend, with_entropy=with_entropy)
    assert_values(logp, r_logp, "logp")
    assert_grad(grad, r_grad, torch.float32, "d_logits")
    # entropy alone drives the gradient
    x = logits.clone().requires_grad_(True)
    _, ent = vf.logprobs_from_logits(x, labels, 1.3, True, backend=backend[1])
    ent.sum().backward()
    x64 = logits.cpu().double().requires_grad_(True)
    reference(x64 / 1.3, labels.cpu())[1].sum().backward()
    assert_grad(x.grad, x64.grad, torch.float32, "d_logits from entropy alone")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale,offset", [(1e3, 0.0), (50.0, 3e4), (1e-3, -5e3)])
def test_large_magnitude_logits_do_not_overflow(backend, scale, offset):
    torch.manual_seed(3)
    logits = (torch.randn(4, 300) * scale + offset).to(backend[0])
    labels = torch.randint(0, 300, (4,), device=backend[0])
    (logp, ent, grad), (r_logp, r_ent, r_grad) = run(logits, labels, 1.0, backend)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()
    # fp32 logits of magnitude |x| carry an absolute error of ~|x| * 6e-8 before anything is computed
    atol = 1e-4 + 2e-7 * (abs(offset) + 5 * scale)
    assert_values(logp, r_logp, "logp", atol=atol)
    assert_values(ent, r_ent, "entropy", atol=atol)
    assert_grad(grad, r_grad, torch.float32, "d_logits", rtol=atol)


@pytest.mark.parametrize("backend", BACKENDS)  # for Triton: the kernel's two passes
@pytest.mark.parametrize("spike", [0.0, 30.0, 43.0, 46.0, 500.0, "masked-first-block"])
def test_triton_rows_whose_largest_logits_come_late(backend, spike):
    """The forward sums against the first block's max; a row whose later logits exceed it by more
    than 64 log2 units (44 nats) must take the running-max pass, below that the fixed one."""
    from verl_fast.kernels.logprobs_from_logits import logprobs_config

    torch.manual_seed(8)
    V = 200
    logits = torch.randn(5, V) * 2
    if spike == "masked-first-block":  # a vocabulary mask of -inf over the first blocks
        logits[:, :40] = float("-inf")
        labels = torch.randint(40, V, (5,))
    else:
        logits[:, 150] += spike  # the first block (16 logits) sees none of it
        labels = torch.randint(0, V, (5,))
        labels[0] = 150
    logits, labels = logits.to(backend[0]), labels.to(backend[0])
    kw = dict(config=logprobs_config(V, block_v=16)) if backend[1] == "triton" else {}
    (logp, ent, grad), (r_logp, r_ent, r_grad) = run(logits, labels, 1.0, backend, **kw)
    assert_values(logp, r_logp, "logp")
    assert_values(ent, r_ent, "entropy")
    assert_grad(grad, r_grad, torch.float32, "d_logits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_logits(backend):
    torch.manual_seed(4)
    full = torch.randn(3, 9, 130, device=backend[0], dtype=torch.bfloat16)
    sliced = full[:, 2:-1]  # what a causal LM's logits[:, -L-1:-1] looks like: no copy is made
    labels = torch.randint(0, 130, (3, 6), device=backend[0])
    (logp, ent, grad), (r_logp, r_ent, r_grad) = run(sliced, labels, 0.9, backend)
    assert_values(logp, r_logp, "logp")
    assert_values(ent, r_ent, "entropy")
    assert_grad(grad, r_grad, torch.bfloat16, "d_logits")
    strided = torch.randn(2, 130, 5, device=backend[0]).transpose(1, 2)  # vocabulary stride 5
    labels = torch.randint(0, 130, (2, 5), device=backend[0])
    (logp, ent, grad), (r_logp, r_ent, r_grad) = run(strided, labels, 1.0, backend)
    assert_values(logp, r_logp, "logp (vocabulary-strided)")
    assert_grad(grad, r_grad, torch.float32, "d_logits (vocabulary-strided)")


def test_chunked_torch_path_huge_vocab_and_many_chunks(monkeypatch):
    torch.manual_seed(5)
    V = 262144  # 16 rows per chunk at the default chunk size: 20 rows take two chunks
    logits = torch.randn(20, V, dtype=torch.bfloat16) * 3
    labels = torch.randint(0, V, (20,))
    (logp, ent, grad), (r_logp, r_ent, r_grad) = run(logits, labels, 1.0, ("cpu", "torch"))
    assert_values(logp, r_logp, "logp")
    assert_values(ent, r_ent, "entropy")
    assert_grad(grad, r_grad, torch.bfloat16, "d_logits")
    monkeypatch.setattr(_logprobs_torch, "CHUNK_ELEMENTS", 64)  # one row per chunk, across a [B, T] layout
    logits = torch.randn(3, 4, 50)
    labels = torch.randint(0, 50, (3, 4))
    (logp, ent, grad), (r_logp, r_ent, r_grad) = run(logits, labels, 0.5, ("cpu", "torch"))
    assert_values(logp, r_logp, "logp")
    assert_values(ent, r_ent, "entropy")
    assert_grad(grad, r_grad, torch.float32, "d_logits")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(B=st.integers(1, 3), T=st.integers(1, 6), V=st.integers(1, 70), temperature=st.floats(0.3, 3.0),
       chunk=st.integers(1, 300), scale=st.floats(0.1, 30.0), seed=st.integers(0, 2**16))
def test_chunked_torch_path_hypothesis(B, T, V, temperature, chunk, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen) * scale
    labels = torch.randint(0, V, (B, T), generator=gen)
    with mock.patch.object(_logprobs_torch, "CHUNK_ELEMENTS", chunk):
        (logp, ent, grad), (r_logp, r_ent, r_grad) = run(logits, labels, temperature, ("cpu", "torch"), seed=seed)
    assert_values(logp, r_logp, "logp")
    assert_values(ent, r_ent, "entropy")
    assert_grad(grad, r_grad, torch.float32, "d_logits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    x = torch.randn(0, 5, 11, device=backend[0], requires_grad=True)
    labels = torch.zeros(0, 5, dtype=torch.long, device=backend[0])
    logp, ent = vf.logprobs_from_logits(x, labels, with_entropy=True, backend=backend[1])
    assert logp.shape == (0, 5) and ent.shape == (0, 5)
    (logp.sum() + ent.sum()).backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [-1, 10, 2**40], ids=["negative", "V", "huge"])
def test_label_range_checked_on_every_backend(backend, bad):
    device, name = backend
    logits = torch.randn(3, 4, 10, device=device)
    labels = torch.randint(0, 10, (3, 4), device=device)
    labels[1, 2] = bad
    with pytest.raises(ValueError, match=rf"labels must lie in \[0, V\) = \[0, 10\); got values from .* to "):
        vf.logprobs_from_logits(logits, labels, with_entropy=True, backend=name)
    labels[1, 2] = 9  # the largest valid label, and a fresh call: the kernel's count starts at zero each time
    vf.logprobs_from_logits(logits, labels, backend=name)
    if name == "triton":  # unchecked: the bad token's log-prob is NaN, the others are right
        labels[1, 2] = bad
        logp = vf.logprobs_from_logits(logits, labels, backend=name, check=False)
        assert torch.isnan(logp[1, 2]) and torch.isfinite(logp.view(-1)[:6]).all()


def test_backends_agree_and_labels_dtypes():
    torch.manual_seed(6)
    logits = torch.randn(2, 3, 40)
    labels = torch.randint(0, 40, (2, 3))
    expected = vf.logprobs_from_logits(logits, labels, backend="torch")
    for dtype in (torch.int32, torch.int16, torch.uint8):
        torch.testing.assert_close(vf.logprobs_from_logits(logits, labels.to(dtype)), expected)
    torch.testing.assert_close(vf.logprobs_from_logits(logits, labels, check=False), expected)
    torch.testing.assert_close(vf.logprobs_from_logits(logits, labels, torch.tensor(1.0)), expected)


def test_bad_inputs_name_the_argument(monkeypatch):
    logits = torch.randn(2, 3, 10)
    labels = torch.arange(6).view(2, 3) + 4  # 4..9
    f = vf.logprobs_from_logits
    cases = [
        (lambda: f(logits.numpy(), labels), TypeError, "logits must be a torch.Tensor"),
        (lambda: f(logits.double(), labels), TypeError, "logits must be float32"),
        (lambda: f(logits.long(), labels), TypeError, "logits must be float32"),
        (lambda: f(torch.randn(2, 0), labels[0, :2]), ValueError, "V >= 1"),
        (lambda: f(logits, labels.float()), TypeError, "labels must be an integer tensor"),
        (lambda: f(logits, labels[:, :2]), ValueError, r"labels must have shape \[2, 3\]"),
        (lambda: f(logits, labels.to("meta")), ValueError, "labels must be on cpu"),
        (lambda: f(logits, labels - 5), ValueError, r"labels must lie in \[0, V\) = \[0, 10\)"),
        (lambda: f(logits, labels + 1), ValueError, "got values from"),
        (lambda: f(logits, labels, 0.0), ValueError, "temperature must be a finite number > 0"),
        (lambda: f(logits, labels, -1.0), ValueError, "temperature"),
        (lambda: f(logits, labels, float("nan")), ValueError, "temperature"),
        (lambda: f(logits, labels, torch.ones(2)), ValueError, "temperature must be a number"),
        (lambda: f(logits, labels, backend="cuda"), ValueError, "backend must be"),
    ]
    for call, err, msg in cases:
        with pytest.raises(err, match=msg):
            call()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises((ValueError, ImportError), match="TRITON_INTERPRET=1|pip install triton"):
        f(logits, labels, backend="triton")
    monkeypatch.setenv("VERL_FAST_LOGPROBS_BACKEND", "bogus")
    with pytest.raises(ValueError, match="VERL_FAST_LOGPROBS_BACKEND"):
        f(logits, labels)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,V", [(1, 151936), (257, 32000), (1024, 151936), (64, 262144)])
def test_cuda_matches_cpu_path_at_scale(dtype, N, V):
    torch.manual_seed(7)
    logits = (torch.randn(N, V, device="cuda") * 3).to(dtype)
    labels = torch.randint(0, V, (N,), device="cuda")
    (logp, ent, grad), (r_logp, r_ent, r_grad) = run(logits, labels, 0.8, ("cuda", "triton"))
    assert_values(logp, r_logp, "logp")
    assert_values(ent, r_ent, "entropy")
    assert_grad(grad, r_grad, dtype, "d_logits")
    (c_logp, c_ent, c_grad), _ = run(logits, labels, 0.8, ("cuda", "torch"))
    torch.testing.assert_close(logp, c_logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent, c_ent, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_forward_extra_memory_is_o_tokens():
    N, V = 2048, 151936
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (N,), device="cuda")
    vf.logprobs_from_logits(logits, labels, with_entropy=True)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = vf.logprobs_from_logits(logits, labels, with_entropy=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= 64 * N + (1 << 20), f"forward allocated {extra} bytes for {N} tokens"
    del out


def test_without_triton_cpu_works_and_triton_backend_says_what_to_install(monkeypatch):
    from verl_fast.ops import logprobs as ops

    monkeypatch.setattr(ops, "_has_triton", lambda: False)
    logits = torch.randn(3, 20)
    labels = torch.randint(0, 20, (3,))
    r_logp, _ = reference(logits.double(), labels)
    assert_values(vf.logprobs_from_logits(logits, labels), r_logp, "logp without Triton")
    assert_values(vf.linear_logprobs(logits, torch.eye(20), labels), r_logp, "linear logp without Triton")
    with pytest.raises(ImportError, match="pip install triton"):
        vf.logprobs_from_logits(logits, labels, backend="triton")
