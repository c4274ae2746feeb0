"""logprobs_from_logits' label check as users call it: the forward kernel counts bad labels into a
counter kept per (device, stream, thread), whose total the call copies into a pinned slot
(pending_checks) without waiting; a total that grew is confirmed on the call's labels before it is
reported, so a count left over (a call cut short between launch and copy) is never a false error. The autograd context is entered only
where something must switch (autocast on, another CUDA device)."""

import pytest
import torch

import verl_fast as vf
from verl_fast.kernels import autograd as AG
from verl_fast.ops import logprobs as L


def ref(logits, labels):
    return torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)


def test_a_left_over_count_is_never_a_false_error():
    counted = L._Counted()
    good, bad = torch.tensor([0, 3, 7]), torch.tensor([0, 9, 2])
    assert L._LabelVerdict(counted, good, 8, torch.device("cpu"))(2) is None  # 2 left by a call cut short
    assert counted.seen == 2
    message = L._LabelVerdict(counted, bad, 8, torch.device("cpu"))(3)
    assert message == "labels must lie in [0, V) = [0, 8); got values from 0 to 9"
    assert L._LabelVerdict(counted, bad, 8, torch.device("cpu"))(3) is None  # the total did not grow
    where = L._LabelVerdict(L._Counted(), bad, 8, torch.device("cuda", 1))(1)
    assert where.endswith("(in a logprobs_from_logits call on cuda:1, checked once its kernels ran)")


def test_triton_check_is_queued_and_raised_by_the_call_on_cpu():
    """The Triton path (interpreter on the CPU) queues its counter's copy; on the CPU it has landed
    when the call returns, so the call itself raises, and the next good call does not."""
    pytest.importorskip("triton")
    if not L._has_triton() or __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path on CPU tensors needs TRITON_INTERPRET=1")
    logits = torch.randn(2, 3, 11)
    labels = torch.randint(0, 11, (2, 3))
    bad = labels.clone()
    bad[1, 2] = 11
    with pytest.raises(ValueError, match=r"labels must lie in \[0, V\) = \[0, 11\); got values from \d+ to 11$"):
        vf.logprobs_from_logits(logits, bad, backend="triton")
    for _ in range(2):
        got = vf.logprobs_from_logits(logits, labels, backend="triton")
        torch.testing.assert_close(got.double(), ref(logits, labels), atol=1e-5, rtol=1e-5)


def test_context_entered_only_to_switch():
    x = torch.zeros(2)
    assert AG._as_implemented(x) is AG._UNCHANGED
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ctx = AG._as_implemented(x)
        assert ctx is not AG._UNCHANGED
        with ctx:
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")


def test_autocast_still_off_inside_the_op():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = vf.logprobs_from_logits(logits, labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref(logits, labels), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_check_never_waits_and_reports_once():
    """On CUDA the call returns before its count lands: raise_pending() (or a later checking call)
    raises it once; the counters are per stream and never give a false error."""
    from verl_fast.ops import pending_checks as P

    torch.manual_seed(0)
    logits = torch.randn(4, 6, 301, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, 301, (4, 6), device="cuda")
    for _ in range(3):
        got = vf.logprobs_from_logits(logits, labels)
        torch.testing.assert_close(got.double(), ref(logits, labels), atol=2e-2, rtol=0)
    P.raise_pending()
    bad = labels.clone()
    bad[2, 3] = 301
    torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU work queued ahead of the call
    vf.logprobs_from_logits(logits, bad)
    assert not torch.cuda.current_stream().query()  # the call returned without waiting for the GPU
    with pytest.raises(ValueError, match=r"got values from \d+ to 301 \(in a logprobs_from_logits call on cuda"):
        P.raise_pending()
    P.raise_pending()  # reported once
    vf.logprobs_from_logits(logits, labels)  # no false error after the failing call
    P.raise_pending()
    counter = L._bad_label_counter(logits.device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with pytest.raises(ValueError, match="labels must lie in"):
            vf.logprobs_from_logits(logits, bad)
            P.raise_pending()
        vf.logprobs_from_logits(logits, labels)
        P.raise_pending()
    assert L._bad_label_counter(logits.device) is counter  # each stream its own
