"""One rank of test_hybrid_engine.py: an FSDP2 actor (gloo, 2 processes) trained with GRPO while
every rank runs its own in-process vLLM-CPU engine (external launcher, TP groups of ``tp``
consecutive ranks). After training each rank's engine must decode greedily what the trained
actor decodes through HF, and each rank must have received exactly the bytes of its TP shard
that it did not hold.

    python hybrid_worker.py RANK WORLD PORT MODEL_DIR OUT_DIR TP
"""

import json
import os
import sys

import torch
import torch.distributed as dist

PROMPTS = [{"prompt": f"What is {a} + {b}?"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4)]]


def greedy_hf(model, prompts, tokens):
    out = []
    for ids in prompts:
        seq = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        out.append(seq[0, len(ids):].tolist())
    return out


def grpo_config(out_dir: str, tp: int, **actor):
    """3 GRPO steps with vLLM rollout at TP ``tp``; ``actor``: more actor settings."""
    return {"actor": {"lr": 2e-2, "micro_batch_size": 16, **actor},
            "rollout": {"type": "auto", "n": 4, "max_new_tokens": 4, "dtype": "float32", "max_model_len": 96,
                        "max_num_seqs": 16, "tensor_parallel_size": tp},
            "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
            "trainer": {"total_steps": 3, "train_batch_size": 4, "output_dir": out_dir, "progress_bar": False,
                        "plot": False, "save_freq": 0, "max_prompt_length": 64}}


def main(rank: int, world: int, port: int, model_dir: str, out_dir: str, tp: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), VLLM_CPU_KVCACHE_SPACE="1")
    from verl_fast.rollout.vllm_env import configure_vllm_env

    configure_vllm_env()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reshard_dist_worker import received_reference
    from verl_fast.rollout.base import SamplingSpec
    from verl_fast.trainer.rl_trainer import RLTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=grpo_config(out_dir, tp), model_path=None,
                        reward_fn=lambda solution_str: float(len(solution_str) % 2))
    history = trainer.fit(PROMPTS)
    moved = trainer.engine.sync_from(model)["bytes"]  # what one sync moves into this rank
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # collective
    trained = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trained.load_state_dict(full)
    trained.eval()
    rows = trainer.processor.encode_all(PROMPTS)
    prompts = [r.prompt_ids for r in rows]
    # this rank's own engine (its TP group decodes the same prompts together)
    out = trainer.engine.engine.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_tokens=6))
    engine = [out.response_ids[i][: int(out.response_mask[i].sum())].tolist() for i in range(len(prompts))]
    minimum = received_reference(initial.state_dict(), initial.config, tp, rank % tp, rank, world) * 4
    result = {"history": history, "engine": engine, "trained": greedy_hf(trained, prompts, 6),
              "initial": greedy_hf(initial, prompts, 6), "bytes": moved, "minimum": minimum,
              "engine_type": type(trainer.engine.engine).__name__}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    trainer.engine.close()  # vLLM's shutdown also tears down the default process group


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]))
