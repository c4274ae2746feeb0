"""logprobs_from_logits' label check as users call it: the forward kernel counts bad labels into a
counter kept per (device, stream, thread) at zero, read once per call; a call that finds labels out
of range raises and leaves the counter at zero, and a count left over (a call cut short between
launch and read) costs a min/max pass, never a false error. The autograd context is entered only
where something must switch (autocast on, another CUDA device)."""

import pytest
import torch

import verl_fast as vf
from verl_fast.kernels import autograd as AG
from verl_fast.ops import logprobs as L


def ref(logits, labels):
    return torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)


def test_a_left_over_count_is_never_a_false_error():
    flat = torch.tensor([0, 3, 7])
    count = torch.tensor([2], dtype=torch.int32)  # left by a call cut short
    L._check_range(flat, 8, count)
    assert count.item() == 0
    count.fill_(1)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, V\) = \[0, 5\); got values from 0 to 7"):
        L._check_range(flat, 5, count)
    assert count.item() == 0
    L._check_range(flat, 8, count)  # zero again: no pass over the labels at all


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
def test_counter_on_cuda_kept_at_zero_across_calls():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 301, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, 301, (4, 6), device="cuda")
    for _ in range(3):
        got = vf.logprobs_from_logits(logits, labels)
        torch.testing.assert_close(got.double(), ref(logits, labels), atol=2e-2, rtol=0)
    bad = labels.clone()
    bad[2, 3] = 301
    with pytest.raises(ValueError, match=r"got values from \d+ to 301"):
        vf.logprobs_from_logits(logits, bad)
    counter = L._bad_label_counter(logits.device)
    assert counter.item() == 0
    vf.logprobs_from_logits(logits, labels)  # no false error after the failing call
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with pytest.raises(ValueError, match="labels must lie in"):
            vf.logprobs_from_logits(logits, bad)
        vf.logprobs_from_logits(logits, labels)
    assert L._bad_label_counter(logits.device) is counter  # each stream its own
