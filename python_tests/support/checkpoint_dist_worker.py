"""One rank of a 2-process FSDP2 run that trains 2 steps and checkpoints:
``python checkpoint_dist_worker.py RANK WORLD PORT MODEL_DIR OUT_DIR BACKEND`` (gloo on CPU, nccl on GPUs). Rank 0 also writes the full
(gathered) weights and optimizer state at the end to ``OUT_DIR/reference.pt``, what a resume must restore."""

import os
import sys

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, model_dir: str, out_dir: str, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.manual_seed(0)
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.trainer.rl_trainer import RLTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    tok = AutoTokenizer.from_pretrained(model_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    prompts = [{"prompt": f"What is {i} + 2?"} for i in range(8)]
    cfg = {"actor": {"lr": 1e-2}, "rollout": {"type": "hf", "n": 4, "max_new_tokens": 5},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 2, "train_batch_size": 4, "output_dir": out_dir, "progress_bar": False,
                       "plot": False, "hf_export": "none"}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg,
                        reward_fn=lambda solution_str: float(len(solution_str) % 2))
    trainer.fit(prompts)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=full)
    optim = get_optimizer_state_dict(model, trainer.strategy.optimizer, options=full)
    if rank == 0:
        torch.save({"weights": weights, "optim": optim["state"]}, os.path.join(out_dir, "reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
