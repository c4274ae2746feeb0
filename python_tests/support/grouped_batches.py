"""Batches of GRPO-style groups (one left-padded prompt, several right-padded responses) and their float64
reference log-probs, one row at a time with the padding removed: shared by the tests of the shared-prompt,
packed and compiled forward paths."""

import torch


def grouped_batch(vocab, prompt_lens, n, resp_lens, seed=0):
    """Groups of n rows: one left-padded prompt each, then right-padded responses of given lengths."""
    g = torch.Generator().manual_seed(seed)
    P, L = max(prompt_lens), max(max(resp_lens), 1)
    rows, masks, group = [], [], []
    for k, plen in enumerate(prompt_lens):
        prompt = torch.randint(1, vocab, (plen,), generator=g)
        for j in range(n):
            rlen = resp_lens[(k * n + j) % len(resp_lens)]
            ids = torch.zeros(P + L, dtype=torch.long)
            mask = torch.zeros(P + L, dtype=torch.long)
            ids[P - plen:P], mask[P - plen:P] = prompt, 1
            ids[P:P + rlen], mask[P:P + rlen] = torch.randint(1, vocab, (rlen,), generator=g), 1
            rows.append(ids), masks.append(mask), group.append(k)
    return torch.stack(rows), torch.stack(masks), torch.tensor(group), L


def row_by_row_logprobs(model, ids, mask, L, temperature):
    """float64, one row at a time, padding removed: log p(token | everything before it)."""
    model = model.double()
    out = torch.zeros(ids.shape[0], L, dtype=torch.float64)
    for r in range(ids.shape[0]):
        n_resp = int(mask[r, -L:].sum())
        if n_resp == 0:
            continue
        seq = ids[r][mask[r].bool()][None]
        logits = model(input_ids=seq).logits[0].double() / temperature
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, seq[0, 1:, None])[:, 0]
        out[r, :n_resp] = lp[-n_resp:]
    return out
