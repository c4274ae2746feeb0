"""One rank of the 2-process FSDP2 (gloo) vision-language test: ``python vlm_dist_worker.py RANK WORLD PORT
OUT_DIR``. A tiny Qwen2-VL (the vision tower trained, so its gradients through the pixel rows count) takes
one SFT step on rows of one or two pictures, sharded with ``actor.strategy: fsdp2``; rank 0 writes the
log-probs of every row before the step and the full weights after it, which the test compares with
one process's run of the same rows (``run``)."""

import os
import sys

import torch

from tiny_vlm import build_vlm, square_image


def rows():
    """Rows of one or two pictures (every rank's micro-batches then run the vision tower)."""
    out = []
    for i, count in enumerate((1, 2, 2, 1)):
        pictures = [square_image(1 + (i + k) % 3, 56 + 28 * ((i + k) % 2), 10 * i + k) for k in range(count)]
        content = [{"type": "image"}] * count + [{"type": "text", "text": "How many red squares?"}]
        out.append({"images": pictures, "messages": [{"role": "user", "content": content},
                                                     {"role": "assistant", "content": f"there are {i % 3 + 1}"}]})
    return out


def run(out_dir: str, strategy: str) -> dict:
    """The log-probs of every row before one SFT step, the step's metrics and the weights after it."""
    model, processor = build_vlm("qwen2_vl")
    cfg = {"actor": {"lr": 1e-2, "micro_batch_size": 1, "strategy": strategy, "freeze_vision_tower": False},
           "algorithm": {"type": "sft"},
           "trainer": {"total_steps": 1, "train_batch_size": 4, "output_dir": out_dir, "progress_bar": False,
                       "plot": False, "save_freq": -1, "device": "cpu"}}
    from verl_fast.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer(actor_model=model, tokenizer=processor, config=cfg)
    examples = trainer.algorithm.encode(trainer.processor, rows())
    exp = trainer.algorithm.experience(examples, processor.tokenizer.pad_token_id, trainer.device)
    with torch.no_grad():
        logprobs = trainer.strategy.actor_logprobs(exp, trainer.updates.micro(exp, for_update=False))
    history = trainer.fit(examples)
    return {"logprobs": logprobs, "history": history, "weights": full_weights(trainer.actor)}


def full_weights(model: torch.nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not torch.distributed.is_initialized():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    result = run(out_dir, "fsdp2")
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "rank0.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
