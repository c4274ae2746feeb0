"""References for rollout-engine tests: what a Hugging Face model itself generates and scores.

Shared by the vLLM engine tests and any other engine's: compare an engine's ``GenerationOutput``
with ``ref_greedy`` (HF ``generate``) and ``ref_logprobs`` (float64 ``log_softmax`` of HF logits).
"""

import torch


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
