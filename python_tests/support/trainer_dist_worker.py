"""One rank of the 2-process FSDP2 (gloo) trainer test: ``python trainer_dist_worker.py RANK WORLD
PORT MODEL_DIR OUT_DIR [lora]``: the model wrapped by the caller, or with ``lora`` adapters and
sharding from the config (``actor.lora``, ``actor.strategy: fsdp2``)."""

import json
import os
import sys

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, model_dir: str, out_dir: str, lora: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.trainer.rl_trainer import RLTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    actor = {"lr": 1e-3, "use_dynamic_bsz": True, "max_token_len_per_gpu": 96}
    if lora:
        actor.update(strategy="fsdp2", lora={"r": 4})
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    prompts = [{"prompt": "What is 1 + 2?" + " please" * (i * 3)} for i in range(8)]  # mixed lengths
    cfg = {"actor": actor,
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 2, "train_batch_size": 4, "output_dir": out_dir, "progress_bar": False,
                       "plot": False}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg,
                        reward_fn=lambda solution_str: float(len(solution_str) % 2))
    history = trainer.fit(prompts)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        if lora:  # the adapters' B started at zero: trained, they are not
            changed = any(bool(v.abs().max() > 0) for k, v in full.items() if ".lora_B." in k)
        else:
            after = torch.cat([full[k].flatten() for k, _ in AutoModelForCausalLM.from_pretrained(
                model_dir).named_parameters()])
            changed = bool((after - before).abs().max() > 0)
        json.dump({"history": history, "changed": changed}, open(os.path.join(out_dir, "rank0.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:] == ["lora"])
