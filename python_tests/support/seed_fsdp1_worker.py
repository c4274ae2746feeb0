"""One rank of test_seed_snippets.py's FSDP1 case, launched by torchrun (gloo on the CPU): seed 000 §3's
snippet as written, an FSDP1 actor with ``use_orig_params=False`` (flat parameters) handed to RLTrainer,
trained for 2 GRPO steps with HF or vLLM rollout. Rank 0 writes each step's metrics and the greedy
decodes of the trained actor (through FSDP1's full parameters) beside those of the untrained model.

    torchrun --nproc_per_node 2 seed_fsdp1_worker.py MODEL_DIR OUT_DIR hf|vllm
"""

import functools
import json
import os
import sys

import torch
import torch.distributed as dist

PROMPTS = [{"prompt": f"What is {a} + {b}?"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


def greedy(model, prompts, tokens=4):
    out = []
    for ids in prompts:
        seq = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        out.append(seq[0, len(ids):].tolist())
    return out


def main(model_dir: str, out_dir: str, rollout: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_refs import EngineReference
    from verl_fast.records.generation import SamplingSpec
    from verl_fast.trainer.rl_trainer import RLTrainer

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layer = type(model.model.layers[0])
    fsdp_model = FSDP(  # seed 000 §3.1, with use_orig_params=False as §3.2 describes
        model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=False, device_id=torch.device("cpu"))
    cfg = {"actor": {"lr": 2e-2, "micro_batch_size": 8},
           "rollout": {"type": rollout, "n": 2, "max_new_tokens": 4, "max_model_len": 96, "max_num_seqs": 8,
                       "enforce_eager": True},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 2, "train_batch_size": 4, "output_dir": out_dir, "progress_bar": False,
                       "plot": False, "save_freq": 0, "max_prompt_length": 64, "device": "cpu"}}
    trainer = RLTrainer(actor_model=fsdp_model, tokenizer=tok, config=cfg, model_path=None,
                        reward_fn=lambda solution_str: float(len(solution_str) % 2))
    history = trainer.fit(PROMPTS)
    prompts = [r.prompt_ids for r in trainer.processor.encode_all(PROMPTS)]
    with FSDP.summon_full_params(fsdp_model, writeback=False):
        trained = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                   for k, v in fsdp_model.module.state_dict().items()}
    engine = trainer.engine.engine if hasattr(trainer.engine, "engine") else trainer.engine
    out = engine.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_tokens=4))
    engine_greedy = [out.response_ids[i][: int(out.response_mask[i].sum())].tolist() for i in range(len(prompts))]
    if dist.get_rank() == 0:
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        initial = greedy(reference, prompts)
        reference.load_state_dict(trained)
        ok = "ok"
        try:  # the engine decodes as the trained actor does (near-ties in its float rounding allowed)
            for ids, toks in zip(prompts, engine_greedy):
                EngineReference(reference).assert_greedy(toks, ids, 4)
        except AssertionError as e:
            ok = str(e)
        result = {"history": history, "engine_type": type(engine).__name__, "initial": initial,
                  "trained": greedy(reference, prompts), "engine": engine_greedy, "engine_ok": ok}
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    if hasattr(engine, "close"):
        engine.close()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], sys.argv[2], sys.argv[3])
