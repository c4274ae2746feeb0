"""The fused LoRA linear (models/lora_linear.py): its output and every gradient against a float64
reference of ``x W^T + b + s (x A^T) B^T`` written here, on random shapes; a peft model's loss and
adapter gradients with it equal peft's own forward; the layers it leaves to peft (adapters off,
dropout, merged) run peft's forward; and the trainer's passes take it when ``FUSED`` is on."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiny_models import build_model
from verl_fast.models import lora_linear

peft = pytest.importorskip("peft")


def reference(x, w, bias, a, b, s, g):
    """float64: the output and the gradients of sum(y * g) with respect to x, A and B."""
    x, w, a, b = (t.detach().double().requires_grad_(t.requires_grad) for t in (x, w, a, b))
    y = x @ w.T + s * (x @ a.T) @ b.T + (0 if bias is None else bias.double())
    grads = torch.autograd.grad((y * g.double()).sum(), (x, a, b))
    return y, grads


@settings(max_examples=40, deadline=None)
@given(lead=st.sampled_from([(5,), (2, 3), (1, 1, 4), (0,)]), in_f=st.integers(1, 24), out_f=st.integers(1, 24),
       r=st.integers(1, 8), s=st.floats(0.1, 4.0), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 10_000))
def test_output_and_gradients_match_float64(lead, in_f, out_f, r, s, bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, in_f, generator=g).to(dtype).requires_grad_()
    w = torch.randn(out_f, in_f, generator=g).to(dtype)  # frozen: no gradient asked
    bb = torch.randn(out_f, generator=g).to(dtype) if bias else None
    a = (torch.randn(r, in_f, generator=g) / 2).to(dtype).requires_grad_()
    b = (torch.randn(out_f, r, generator=g) / 2).to(dtype).requires_grad_()
    up = torch.randn(*lead, out_f, generator=g).to(dtype)  # the upstream gradient
    y = lora_linear._LoraLinear.apply(x, w, bb, a, b, s)
    gx, ga, gb = torch.autograd.grad((y * up).sum(), (x, a, b))
    want_y, (wx, wa, wb) = reference(x, w, bb, a, b, s, up)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=4e-2, atol=8e-2 * (1 + in_f) ** 0.5)
    assert y.dtype == dtype and y.shape == (*lead, out_f)
    for got, want in ((y, want_y), (gx, wx), (ga, wa), (gb, wb)):
        torch.testing.assert_close(got.double(), want, **tol)


def _peft_model(seed=0, dropout=0.0, bias=True):
    torch.manual_seed(seed)
    model = peft.get_peft_model(build_model("qwen2"), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                                      target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # peft starts B at zero: the adapter path would add nothing
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("autocast", [False, True])
def test_a_peft_model_trains_the_same_through_the_fused_layers(autocast):
    model = _peft_model()
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else torch.enable_grad
    with ctx():
        loss, grads = _loss_and_grads(model, ids)
        with lora_linear.fused(model):
            assert sum("forward" in vars(m) for m in model.modules()) == 7 * model.config.num_hidden_layers
            fused_loss, fused_grads = _loss_and_grads(model, ids)
    assert not any("forward" in vars(m) for m in model.modules())  # peft's own forward back
    tol = dict(rtol=1e-5, atol=1e-6) if not autocast else dict(rtol=5e-2, atol=5e-3)
    torch.testing.assert_close(fused_loss, loss, **tol)
    assert grads.keys() == fused_grads.keys() and len(grads) == 2 * 7 * model.config.num_hidden_layers
    for name in grads:
        torch.testing.assert_close(fused_grads[name], grads[name], **tol, msg=name)


def test_layers_it_does_not_cover_run_pefts_forward(monkeypatch):
    calls = []
    real = lora_linear._LoraLinear.apply
    monkeypatch.setattr(lora_linear._LoraLinear, "apply", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, 320, (2, 8), generator=torch.Generator().manual_seed(2))
    model = _peft_model()
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with lora_linear.fused(model):
            with model.disable_adapter():  # the reference pass of a LoRA actor: the base alone
                off = model(input_ids=ids).logits
            assert not calls
            on = model(input_ids=ids).logits
            assert calls
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    torch.testing.assert_close(off, base)
    torch.testing.assert_close(on, plain, rtol=1e-5, atol=1e-5)
    calls.clear()
    dropped = _peft_model(dropout=0.1)  # dropout: peft's forward draws the mask
    with torch.no_grad(), lora_linear.fused(dropped):
        dropped(input_ids=ids)
    assert not calls
    with torch.no_grad(), lora_linear.fused(model, on=False):
        assert not any("forward" in vars(m) for m in model.modules())


def test_the_trainers_passes_take_it_when_on(monkeypatch):
    from verl_fast.strategies.fsdp_strategy import passes

    model = _peft_model()
    for on in (False, True):
        monkeypatch.setattr(lora_linear, "FUSED", on)
        with passes(model, compiled=False, packs=False):
            assert any("forward" in vars(m) for m in model.modules()) is on
