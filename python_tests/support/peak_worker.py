"""One update pass (response log-probs, forward and backward) of a tiny random qwen2 model on the CPU,
in a process of its own, printing as JSON the process's peak resident memory above what it held just
before the pass (the kernel's high-water mark ``VmHWM``, reset just before the pass through
``/proc/self/clear_refs``, so nothing earlier in the process, imports included, counts) and the memory
plan's estimate of the same pass (``memory_plan.estimate``: the activations, the plain log-prob head; the
gradients exist before the pass). Run it with ``MALLOC_MMAP_THRESHOLD_=65536``: tensors of 64 KiB and more
are then mapped and unmapped one by one (glibc otherwise raises its threshold and keeps freed blocks), so
the mark follows the live tensors.

    python peak_worker.py LAYERS HIDDEN ROWS TOKENS CHECKPOINTING(0/1)
"""

import gc
import json
import re
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import build_model  # noqa: E402

from verl_fast.config import from_dict  # noqa: E402
from verl_fast.models.response_logprobs import response_logprobs  # noqa: E402
from verl_fast.strategies import memory_plan  # noqa: E402


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_resident() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def main() -> None:
    layers, hidden, rows, tokens, checkpointing = (int(v) for v in sys.argv[1:6])
    torch.set_num_threads(1)
    model = build_model("qwen2", vocab_size=512, num_layers=layers, hidden_size=hidden, num_heads=4,
                        num_kv_heads=2, intermediate_size=4 * hidden, max_position_embeddings=tokens)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(3, 512, (rows, tokens))
    mask = torch.ones_like(ids)
    response = tokens // 2

    def update_pass(n: int) -> None:
        logp, _ = response_logprobs(model, ids[:, :n], mask[:, :n], min(response, n - 1), fused=False)
        logp.sum().backward()

    update_pass(16)  # libraries, thread pools and the gradients' buffers in place
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark back to the resident size now
    before = resident()
    update_pass(tokens)
    peak = peak_resident() - before

    cfg = from_dict({"actor": {"model_name": "m", "autocast": "none", "gradient_checkpointing": bool(checkpointing),
                               "max_token_len_per_gpu": rows * tokens},
                     "rollout": {"max_new_tokens": response, "n": 1},
                     "trainer": {"train_batch_size": rows, "max_prompt_length": tokens - response}})
    shape = memory_plan.shape_of(model)
    est = memory_plan.estimate(cfg, shape, model.config, free_bytes=2**40, compiled=False, fused_head=False)
    # the head's logits cover the response positions only (logits_to_keep); the gradients exist already
    head = memory_plan.head_bytes(rows * response, shape.hidden, shape.vocab, fused=False)
    print(json.dumps({"peak_bytes": peak, "activations": est.activations, "head": head, "mode": est.mode,
                      "micro_tokens": est.micro_tokens}))


if __name__ == "__main__":
    main()
