"""Inputs a long run meets: config values that are NaN or of the wrong type, bad JSONL lines,
pickles that carry code (datasets and Megatron checkpoints), prompts longer than the limit, reward
functions that return the wrong thing or fail on one sample."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import build_tokenizer, save_tiny_model
from verl_fast import config as config_mod
from verl_fast import load_megatron_checkpoint
from verl_fast.data import RLDataProcessor
from verl_fast.strategies.megatron.checkpoint_loader import megatron_args
from verl_fast.rewards import CallableReward, GuardedReward, RewardInput
from verl_fast.trainer.rl_trainer import RLTrainer


# ---- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("override,message", [
    ("actor.clip_ratio=.nan", "actor.clip_ratio must be a finite number, got nan"),
    ("algorithm.gamma=.inf", "algorithm.gamma must be a finite number, got inf"),
    ("actor.entropy_coeff=-.inf", "actor.entropy_coeff must be a finite number, got -inf"),
    ("actor.lr=nan", "actor.lr must be a finite number, got nan"),
    ("algorithm.gamma=abc", "algorithm.gamma must be a number, got 'abc'"),
    ("trainer.seed=100000000000000000000", "trainer.seed must fit in int64"),
])
def test_config_rejects_non_finite_values_naming_the_key(tmp_path, override, message):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: {type: grpo}\n")
    with pytest.raises(ValueError, match=message):
        config_mod.load(path, [override])


def test_a_config_built_in_python_is_checked_too():
    cfg = config_mod.Config()
    cfg.algorithm.gamma = "abc"
    with pytest.raises(ValueError, match="algorithm.gamma must be a number, got 'abc'"):
        config_mod.checked(cfg)
    cfg.algorithm.gamma = float("nan")
    with pytest.raises(ValueError, match="algorithm.gamma must be a finite number"):
        config_mod.checked(cfg)
    cfg.algorithm.gamma = 1
    assert config_mod.checked(cfg).algorithm.gamma == 1.0 and isinstance(cfg.algorithm.gamma, float)


# ---- data ---------------------------------------------------------------------------------------


def test_bad_jsonl_lines_name_the_file_and_line(tmp_path):
    proc = RLDataProcessor(build_tokenizer())
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:3: invalid JSON"):
        proc.load(path)
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: expected a JSON object \(a row\), got list"):
        proc.load(path)
    (tmp_path / "d.json").write_text('[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(ValueError, match=r"d\.json:2: invalid JSON"):
        proc.load(tmp_path / "d.json")


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pt_dataset_is_loaded_as_data_only(tmp_path):
    marker = tmp_path / "ran"
    torch.save([{"prompt": "a"}, RunsCode(marker)], tmp_path / "d.pt")
    with pytest.raises(ValueError, match=r"d\.pt: refused to unpickle the global (posix|os)\.system: a dataset"):
        RLDataProcessor(build_tokenizer()).load(tmp_path / "d.pt")
    assert not marker.exists()
    torch.save([{"prompt": "a", "reward_model": {"ground_truth": "1"}}], tmp_path / "ok.pt")
    assert RLDataProcessor(build_tokenizer()).load(tmp_path / "ok.pt")[0]["prompt"] == "a"


def test_overlong_prompt_policies():
    tok = build_tokenizer()
    rows = [{"prompt": "What is 1 + 2?"}, {"prompt": "What is 1 + 2? " * 40}]
    skip = RLDataProcessor(tok, max_prompt_length=32)
    kept = skip.encode_all(rows)
    assert len(kept) == 1 and skip.skipped_overlong == 1 and len(kept[0].prompt_ids) <= 32
    with pytest.raises(ValueError, match="more than max_prompt_length=32 .*overlong_prompts='error'"):
        RLDataProcessor(tok, max_prompt_length=32, overlong_prompts="error").encode_all(rows)
    cut = RLDataProcessor(tok, max_prompt_length=32, overlong_prompts="truncate_left").encode_all(rows)
    assert len(cut) == 2 and len(cut[1].prompt_ids) == 32
    # the text handed to the reward is the text of the kept tokens, not the full prompt
    assert cut[1].prompt_text == tok.decode(cut[1].prompt_ids) and len(cut[1].prompt_text) < len(rows[1]["prompt"])
    with pytest.raises(ValueError, match="all 1 prompts are longer than max_prompt_length=32"):
        skip.encode_all(rows[1:])
    with pytest.raises(ValueError, match="overlong_prompts must be one of"):
        RLDataProcessor(tok, overlong_prompts="left")


# ---- rewards ------------------------------------------------------------------------------------


def samples(n):
    return [RewardInput(prompt="p", response=str(i), ground_truth=str(i)) for i in range(n)]


def test_a_batch_reward_returning_one_float_says_what_was_expected():
    def scorer(samples):
        return 1.0

    with pytest.raises(TypeError, match="scored a batch of 3 samples and must return one score per sample "
                                        r"\(a list of 3 numbers\), got float"):
        CallableReward(scorer)(samples(3))


def test_reward_on_error():
    def flaky(solution_str):
        if solution_str == "1":
            raise KeyError("no answer")
        return 1.0

    with pytest.raises(KeyError):
        GuardedReward(CallableReward(flaky), "raise")(samples(3))
    guarded = GuardedReward(CallableReward(flaky), "zero")
    assert guarded(samples(3)) == [1.0, 0.0, 1.0] and guarded.last_errors == 1
    assert guarded(samples(1)) == [1.0] and guarded.last_errors == 0
    nan = GuardedReward(CallableReward(lambda solution_str: float("nan")), "zero")
    assert nan(samples(2)) == [0.0, 0.0] and nan.last_errors == 2
    with pytest.raises(ValueError, match="reward_fn.on_error must be one of"):
        GuardedReward(CallableReward(flaky), "skip")


def test_trainer_counts_skipped_prompts_and_zeroed_rewards(tmp_path):
    path = save_tiny_model(tmp_path / "m", family="qwen2")
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    seen = []

    def reward(prompt, solution_str):
        seen.append(prompt)
        if len(seen) % 2:
            raise RuntimeError("scorer failed")
        return 1.0

    rows = [{"prompt": f"What is {i} + 1?"} for i in range(4)] + [{"prompt": "What is 1 + 2? " * 40}]
    cfg = {"rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
           "reward_fn": {"type": "gsm8k", "on_error": "zero"},
           "trainer": {"total_steps": 1, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "device": "cpu", "max_prompt_length": 40}}
    history = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=reward, config=cfg).fit(rows)
    assert history[0]["data/skipped_overlong"] == 1.0
    # the batch call fails at its first sample; one at a time, samples 2 and 4 fail
    assert history[0]["reward/errors"] == 2.0 and len(seen) == 5
    assert all(len(tok(p, add_special_tokens=False)["input_ids"]) <= 40 for p in seen)


# ---- checkpoints ----------------------------------------------------------------------------------


def test_dcp_checkpoints_are_loaded_as_data_only(tmp_path):
    """torch DCP unpickles its .metadata with no allowlist and non-tensor items with
    weights_only=False; safe_load's reader and planner refuse code in either."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from verl_fast.files import safe_load

    marker = tmp_path / "ran"
    good = {"x": torch.arange(4.0), "lr": 0.1}
    dcp.save(good, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    out = {"x": torch.zeros(4), "lr": None}
    dcp.load(out, storage_reader=safe_load.dcp_reader(tmp_path / "ok"), planner=safe_load.dcp_planner(), no_dist=True)
    assert torch.equal(out["x"], good["x"]) and out["lr"] == 0.1
    dcp.save({"x": torch.zeros(4), "evil": RunsCode(marker)}, checkpoint_id=str(tmp_path / "item"), no_dist=True)
    with pytest.raises(BaseException, match=r"checkpoint item evil: refused to unpickle the global (posix|os)\.system"):
        dcp.load({"x": torch.zeros(4), "evil": None}, storage_reader=safe_load.dcp_reader(tmp_path / "item"),
                 planner=safe_load.dcp_planner(), no_dist=True)
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(ValueError, match=r"\.metadata: refused to unpickle the global (posix|os)\.system"):
        safe_load.dcp_reader(meta).read_metadata()
    with pytest.raises(ValueError, match=r"\.metadata: refused to unpickle"):
        load_megatron_checkpoint(meta)  # a torch_dist folder
    assert not marker.exists()


def test_a_megatron_checkpoint_that_carries_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    shard = tmp_path / "legacy" / "iter_0000001" / "mp_rank_00"
    shard.mkdir(parents=True)
    torch.save({"model": {"embedding.word_embeddings.weight": torch.zeros(4, 4)}, "args": RunsCode(marker)},
               shard / "model_optim_rng.pt")
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(ValueError, match=r"mp_rank_00/model_optim_rng\.pt: refused to unpickle the global "
                                         r"(posix|os)\.system"):
        load_megatron_checkpoint(tmp_path / "legacy")
    with pytest.raises(ValueError, match=r"model_optim_rng\.pt: refused to unpickle"):
        megatron_args(tmp_path / "legacy")
    dist_dir = tmp_path / "dist"
    dist_dir.mkdir()
    (dist_dir / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({"args": RunsCode(marker)}, dist_dir / "common.pt")
    with pytest.raises(ValueError, match=r"common\.pt: refused to unpickle"):
        megatron_args(dist_dir)
    assert not marker.exists()
    (dist_dir / "common.pt").write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match=r"common\.pt: not a readable torch file"):
        megatron_args(dist_dir)


def test_megatron_args_with_zero_heads_name_the_file(tmp_path):
    import argparse

    shard = tmp_path / "iter_0000001" / "mp_rank_00"
    shard.mkdir(parents=True)
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=0, ffn_hidden_size=96)
    torch.save({"model": {}, "args": args}, shard / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(ValueError, match=r"model_optim_rng\.pt: Megatron args: num_attention_heads must be an "
                                         "integer >= 1, got 0"):
        load_megatron_checkpoint(tmp_path)
