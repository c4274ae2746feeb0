"""compute_gae's host path as users call it: one allocation for both outputs, a status record kept
per (device, stream, thread) and cleared by every call, the common arguments checked in a few
comparisons. Each call's results against the float64 reference, a failing call followed by good
ones, threads calling at once, and arguments off the common path still checked by name."""

import threading

import numpy as np
import pytest
import torch

import verl_fast as vf
from conftest import DEVICES
from verl_fast.ops import advantage as A


def ref_gae(r, v, m, gamma, lam):
    r, v, m = r.double(), v.double(), m.double()
    B, T = r.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        next_value, last = 0.0, 0.0
        for t in reversed(range(T)):
            delta = r[b, t] + gamma * next_value - v[b, t]
            if m[b, t]:
                next_value = v[b, t]
                last = delta + gamma * lam * last
            adv[b, t] = last
    n = m.sum()
    mean = (adv * m).sum() / n
    var = (((adv - mean) ** 2) * m).sum() / (n - 1)
    return (adv - mean) / torch.sqrt(var + 1e-8), adv + v


def inputs(B, T, device, seed):
    g = torch.Generator().manual_seed(seed)
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    m = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
    return r.to(device), v.to(device), m.to(device)


def close(got, want):
    assert torch.allclose(got.cpu().double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_calls_new_outputs_each_exact(device):
    kept = []
    for seed in range(4):
        r, v, m = inputs(5, 37, device, seed)
        adv, ret = vf.compute_gae(r, v, m, 0.99, 0.95)
        ra, rr = ref_gae(r.cpu(), v.cpu(), m.cpu(), 0.99, 0.95)
        close(adv, ra)
        close(ret, rr)
        kept.append((adv, ret, ra, rr))
    for adv, ret, ra, rr in kept:  # no later call wrote an earlier call's outputs
        close(adv, ra)
        close(ret, rr)
    assert adv.is_contiguous() and ret.is_contiguous() and adv.dtype == ret.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_a_failing_call_leaves_nothing_for_the_next(device):
    r, v, m = inputs(3, 16, device, 0)
    bad = r.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="token_level_rewards contains NaN or inf"):
        vf.compute_gae(bad, v, m, 0.99, 0.95)
    vf.compute_gae(bad, v, m, 0.99, 0.95, check=False)  # unchecked: the record holds the bits, unread
    adv, _ = vf.compute_gae(r, v, m, 0.99, 0.95)  # cleared by this call: no error
    close(adv, ref_gae(r.cpu(), v.cpu(), m.cpu(), 0.99, 0.95)[0])
    with pytest.raises(ValueError, match="whitening needs at least 2 positions"):
        vf.compute_gae(r, v, torch.zeros_like(m), 0.99, 0.95)
    vf.compute_gae(r, v, m, 0.99, 0.95)


def test_threads_keep_their_own_records():
    errors, results = [], {}

    def work(i):
        try:
            for k in range(20):
                r, v, m = inputs(4, 24, "cpu", i)
                if i % 2 and k % 3 == 0:
                    r = r.clone()
                    r[0, 0] = float("inf")
                    with pytest.raises(ValueError, match="contains NaN or inf"):
                        vf.compute_gae(r, v, m, 0.9, 0.8)
                    continue
                results[(i, k)] = (vf.compute_gae(r, v, m, 0.9, 0.8)[0], ref_gae(r, v, m, 0.9, 0.8)[0])
        except Exception as e:  # collected for the main thread's assert
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got, want in results.values():
        close(got, want)


def test_arguments_off_the_common_path_are_still_checked():
    r, v, m = inputs(2, 8, "cpu", 0)
    ra = ref_gae(r, v, m, 1.0, 1.0)[0]
    for gamma in (1, np.float32(1.0), np.float64(1.0)):  # accepted off the plain-float path
        close(vf.compute_gae(r, v, m, gamma, 1.0)[0], ra)
    with pytest.raises(TypeError, match="gamma must be a number, got True"):
        vf.compute_gae(r, v, m, True, 1.0)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\], got 1.5"):
        vf.compute_gae(r, v, m, 1.0, 1.5)
    with pytest.raises(TypeError, match="whiten must be True or False"):
        vf.compute_gae(r, v, m, whiten=1)
    with pytest.raises(TypeError, match="check must be True or False"):
        vf.compute_gae(r, v, m, check="no")
    with pytest.raises(ValueError, match=r"values must have the shape of token_level_rewards \[2, 8\]"):
        vf.compute_gae(r, v[:, :7], m)
    with pytest.raises(TypeError, match="values must be float32"):
        vf.compute_gae(r, v.long(), m)
    float_mask = m.double()  # converted, as before
    close(vf.compute_gae(r, v, float_mask)[0], ra)


def test_status_records_are_bounded():
    A._STATUS.clear()
    r, v, m = inputs(2, 8, "cpu", 0)
    threads = [threading.Thread(target=vf.compute_gae, args=(r, v, m)) for _ in range(A._MAX_STATUS + 5)]
    for t in threads:
        t.start()
        t.join()
    assert len(A._STATUS) <= A._MAX_STATUS
