"""response_logprobs: the fused lm_head path equals the plain logits path (values and gradients) on
tiny random Qwen2 and Llama models built from a config here (no hub access)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from verl_fast.models.response_logprobs import response_logprobs  # noqa: E402

VOCAB = 300


def tiny_model(family: str, tie: bool = False):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=tie)
    config = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[family](**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # random init gives near-uniform softmax; make the head sharper and biased
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def batch(B=3, P=7, L=5):
    torch.manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (B, P + L))
    attention_mask = torch.ones(B, P + L, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding of a shorter prompt
    attention_mask[2, :1] = 0
    attention_mask[0, -2:] = 0  # right padding of a shorter response
    return input_ids, attention_mask, L


def reference(model, input_ids, attention_mask, L, temperature):
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp_all = torch.log_softmax(logits[:, -L - 1 : -1].double() / temperature, -1)
    logp = logp_all.gather(-1, input_ids[:, -L:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def grads_of(model, fn):
    model.zero_grad(set_to_none=True)
    logp, ent = fn()
    g = torch.Generator().manual_seed(2)
    loss = (logp * torch.randn(logp.shape, generator=g).to(logp.device)).sum()
    if ent is not None:
        loss = loss + (ent * torch.randn(ent.shape, generator=g).to(ent.device)).sum()
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("with_entropy,temperature,tie", [(True, 1.0, False), (False, 0.7, False), (True, 0.7, True)])
def test_fused_equals_plain_values_and_gradients(family, with_entropy, temperature, tie):
    model = tiny_model(family, tie)
    ids, mask, L = batch()
    fused = grads_of(model, lambda: response_logprobs(model, ids, mask, L, temperature, with_entropy, fused=True))
    plain = grads_of(model, lambda: response_logprobs(model, ids, mask, L, temperature, with_entropy, fused=False))
    with torch.no_grad():
        r_logp, r_ent = reference(model, ids, mask, L, temperature)
    assert fused[0].shape == (3, L) and fused[0].dtype == torch.float32
    torch.testing.assert_close(fused[0].double(), r_logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(plain[0].double(), r_logp, atol=1e-4, rtol=1e-5)
    if with_entropy:
        torch.testing.assert_close(fused[1].double(), r_ent, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(plain[1], fused[1], atol=1e-5, rtol=1e-5)
    else:
        assert fused[1] is None and plain[1] is None
    assert fused[2].keys() == plain[2].keys()
    for name, g in fused[2].items():
        scale = max(plain[2][name].abs().max().item(), 1e-6)
        err = (g - plain[2][name]).abs().max().item()
        assert err <= 1e-4 * scale, f"grad of {name}: max error {err:.3g} (largest entry {scale:.3g})"


def test_fused_under_bf16_autocast_and_head_restored():
    model = tiny_model("qwen2")
    ids, mask, L = batch()
    with torch.no_grad():
        r_logp, r_ent = reference(model, ids, mask, L, 1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, ent = response_logprobs(model, ids, mask, L, 1.0, True, fused=True)
    # bf16 hidden states and weights: a bf16-sized tolerance on logits of magnitude ~10
    assert (logp.double() - r_logp).abs().max() < 0.5 and (ent.double() - r_ent).abs().max() < 0.5
    assert "forward" not in model.get_output_embeddings().__dict__
    out = model(input_ids=ids, attention_mask=mask)
    assert out.logits.shape == (*ids.shape, VOCAB)


def test_default_is_plain_on_cpu_and_unsupported_families_are_refused():
    model = tiny_model("llama")
    ids, mask, L = batch()
    with torch.no_grad():
        logp, ent = response_logprobs(model, ids, mask, L)  # fused=None: CPU model -> plain path
        r_logp, _ = reference(model, ids, mask, L, 1.0)
    assert ent is None
    torch.testing.assert_close(logp.double(), r_logp, atol=1e-4, rtol=1e-5)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="fused log-probs support the families"):
        response_logprobs(gpt2, ids, mask, L, fused=True)
    with pytest.raises(ValueError, match="response_length"):
        response_logprobs(model, ids, mask, ids.shape[1])


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_cuda_fused_equals_plain(family):
    model = tiny_model(family).cuda()
    ids, mask, L = (t.cuda() if isinstance(t, torch.Tensor) else t for t in batch(B=4, P=20, L=16))
    fused = grads_of(model, lambda: response_logprobs(model, ids, mask, L, 0.9, True))  # default: fused on CUDA
    plain = grads_of(model, lambda: response_logprobs(model, ids, mask, L, 0.9, True, fused=False))
    torch.testing.assert_close(fused[0], plain[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(fused[1], plain[1], atol=1e-4, rtol=1e-5)
    for name, g in fused[2].items():
        scale = max(plain[2][name].abs().max().item(), 1e-6)
        assert (g - plain[2][name]).abs().max().item() <= 1e-3 * scale, name
