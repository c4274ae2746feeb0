"""References for rollout-engine tests: what a Hugging Face model itself generates and scores.

Shared by the vLLM engine tests and any other engine's: compare an engine's ``GenerationOutput``
with ``ref_greedy`` (HF ``generate``) and ``ref_logprobs`` (float64 ``log_softmax`` of HF logits),
or, for an engine in any dtype, through ``EngineReference``.
"""

import copy

import torch

# The dtype the engine tests run vLLM in: float32 on the CPU (vLLM-CPU's fp32 kernels match a float64
# reference to 1e-4), bfloat16 on a GPU (what GPU rollout runs; vLLM's GPU attention for fp32 inputs
# runs its dot products in TF32, so fp32 there is no more exact than bf16 and is not what runs).
ENGINE_DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"
FP32_ATOL = 1e-4
# bf16: the engine's log-probs may differ from the float64 reference by this many times what HF's own
# bf16 forward of the same weights differs by on the same tokens (another correct bf16 implementation:
# both round every activation to 8 mantissa bits, in different places and orders), plus BF16_FLOOR.
BF16_FACTOR = 4.0
BF16_FLOOR = 1e-3


def ref_logprobs(model, prompt, response, temperature=1.0):
    """float64 log_softmax(logits / T) of the HF model, gathered at the response tokens."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def ref_greedy(model, prompt, max_new_tokens):
    """HF greedy continuation of one prompt (stops after EOS, which it includes)."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def rows(out):
    """The completions of a GenerationOutput as (prompt index, tokens, log-probs or None) tuples,
    checking on the way that each response mask is ones then zeros."""
    result = []
    for r in range(out.num_sequences):
        n = int(out.response_mask[r].sum())
        assert out.response_mask[r, :n].eq(1).all() and out.response_mask[r, n:].eq(0).all()
        lp = out.logprobs[r, :n] if out.logprobs is not None else None
        result.append((int(out.prompt_index[r]), out.response_ids[r, :n].tolist(), lp))
    return result


class EngineReference:
    """What an engine holding ``model``'s weights in ``dtype`` must generate: computed in float64 from
    those weights rounded to ``dtype`` (as the engine holds them). Build it after the last change to
    ``model`` that the engine received.

    float32: log-probs within ``FP32_ATOL`` of the reference, greedy tokens equal to HF ``generate``'s.
    bfloat16: log-probs within ``tolerance`` (from HF's own bf16 error on the same tokens, see
    ``BF16_FACTOR``); greedy decoding, whose near-ties bf16 may flip, is checked token by token on the
    engine's own continuation: each chosen token's reference log-prob is within the tolerance of the
    best token's there."""

    def __init__(self, model, dtype: str = ENGINE_DTYPE):
        self.model = model
        self.dtype = getattr(torch, dtype)
        rounded = copy.deepcopy(model).to(self.dtype).eval()
        self.exact = copy.deepcopy(rounded).to(torch.float64).eval()
        self.peer = rounded if self.dtype != torch.float32 else None

    def _all_logprobs(self, model, prompt, response, temperature):
        ids = torch.tensor([list(prompt) + list(response)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
        return torch.log_softmax(logits, -1)

    def tolerance(self, prompt, response, temperature=1.0) -> float:
        if self.peer is None:
            return FP32_ATOL
        exact = self._all_logprobs(self.exact, prompt, response, temperature)
        peer = self._all_logprobs(self.peer, prompt, response, temperature)
        return BF16_FACTOR * float((peer - exact).abs().max()) + BF16_FLOOR

    def assert_logprobs(self, logprobs, prompt, response, temperature=1.0) -> None:
        exact = self._all_logprobs(self.exact, prompt, response, temperature)
        ref = exact.gather(-1, torch.tensor(list(response))[:, None])[:, 0]
        torch.testing.assert_close(logprobs.double(), ref, atol=self.tolerance(prompt, response, temperature), rtol=0)

    def assert_greedy(self, tokens, prompt, max_new_tokens) -> None:
        tokens = list(tokens)
        if self.peer is None:
            assert tokens == ref_greedy(self.model, prompt, max_new_tokens)
            return
        eos = self.model.config.eos_token_id
        assert len(tokens) == max_new_tokens or (tokens and tokens[-1] == eos), tokens
        exact = self._all_logprobs(self.exact, prompt, tokens, 1.0)
        chosen = exact.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        gap = exact.max(-1).values - chosen
        tol = self.tolerance(prompt, tokens)
        assert float(gap.max()) <= tol, f"greedy token {int(gap.argmax())} is {float(gap.max()):.4f} below the best (tolerance {tol:.4f})"
