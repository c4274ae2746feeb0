"""verl's SFT trainer command lines (``torchrun -m verl.trainer.fsdp_sft_trainer key=value ...``, as
verl's examples/sft scripts write them) through ``verl-fast sft``: only the paths and sizes changed;
each runs one step on a tiny model or is refused in one line per problem, all at once."""

import json

import pandas as pd
import pytest

from tiny_models import save_tiny_model
from verl_fast.cli import main as cli
from verl_fast.config import LoraConfig, verl_config
from verl_fast.config.verl_config import ConfigProblems
from verl_fast.trainer import catalog

catalog.register()
QA = [("What is 2 plus 3?", "2 plus 3 is 5. #### 5"), ("What is 4 minus 1?", "4 minus 1 is 3. #### 3"),
      ("What is 6 plus 1?", "6 plus 1 is 7. #### 7"), ("What is 9 minus 4?", "9 minus 4 is 5. #### 5")]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("sft_home")
    save_tiny_model(home / "tiny")
    (home / "gsm8k").mkdir()
    (home / "multiturn").mkdir()
    for split in ("train", "test"):  # as verl's examples/data_preprocess/gsm8k.py writes them
        pd.DataFrame([{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}],
                       "ability": "math", "reward_model": {"style": "rule", "ground_truth": a[-1]},
                       "extra_info": {"split": split, "index": i, "question": q, "answer": a}}
                      for i, (q, a) in enumerate(QA)]).to_parquet(home / "gsm8k" / f"{split}.parquet")
        pd.DataFrame([{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q},
                                    {"role": "assistant", "content": a}, {"role": "user", "content": "Sure?"},
                                    {"role": "assistant", "content": "Yes."}]}
                      for q, a in QA]).to_parquet(home / "multiturn" / f"{split}.parquet")
    return home


def peft_script(home, run):
    """examples/sft/gsm8k/run_qwen_05_peft.sh's arguments, paths and sizes changed."""
    return [f"data.train_files={home}/gsm8k/train.parquet", f"data.val_files={home}/gsm8k/test.parquet",
            "data.prompt_key=extra_info", "data.response_key=extra_info", "optim.lr=1e-4",
            "data.prompt_dict_keys=['question']", "+data.response_dict_keys=['answer']",
            "data.micro_batch_size_per_gpu=2", f"model.partial_pretrain={home}/tiny",
            f"trainer.default_local_dir={run}", "trainer.project_name=gsm8k-sft",
            "trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct", "trainer.logger=console",
            "trainer.total_epochs=1", "data.train_batch_size=4", "data.max_length=128",
            "trainer.total_training_steps=1", "model.lora_rank=8", "model.lora_alpha=16",
            "model.target_modules=all-linear"]


def multiturn_script(home, run, sp=True):
    """examples/sft/multiturn/run_qwen_05_sp2.sh's arguments, paths and sizes changed."""
    return [f"data.train_files={home}/multiturn/train.parquet", f"data.val_files={home}/multiturn/test.parquet",
            "data.multiturn.enable=true", "data.multiturn.messages_key=messages", "data.micro_batch_size=4",
            f"model.partial_pretrain={home}/tiny", f"trainer.default_local_dir={run}",
            "trainer.project_name=multiturn-sft", "trainer.experiment_name=multiturn-sft-qwen-2.5-0.5b-instruct-sp2",
            "trainer.logger=console", "trainer.total_training_steps=1", "data.train_batch_size=4",
            "data.max_length=128"] + (["ulysses_sequence_parallel_size=2", "use_remove_padding=true"] if sp else [])


def steps(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_gsm8k_peft_script_runs_a_step(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = peft_script(home, tmp_path / "run")
    cfg, notes = verl_config.load(None, args, tree="sft")
    assert cfg.algorithm.type == "sft" and cfg.actor.lr == pytest.approx(1e-4)
    assert cfg.algorithm.sft_columns == {"prompt": "extra_info.question", "completion": "extra_info.answer"}
    assert cfg.actor.lora == LoraConfig(r=8, alpha=16, target_modules="all-linear")
    assert cfg.actor.micro_batch_size == 2 and cfg.trainer.save_freq == -1 and cfg.trainer.val_freq == -1
    assert cli.main(["sft", *args]) == 0
    trained = [s for s in steps(tmp_path / "run") if s.get("step") == 1]
    assert len(trained) == 1 and trained[0]["sft/loss"] > 0  # a next-token loss on the answers
    assert not (tmp_path / "run" / "checkpoints").exists()  # verl's save_freq -1: never


def test_multiturn_script_refuses_sequence_parallelism_in_one_line(home, tmp_path, capsys):
    args = multiturn_script(home, tmp_path / "run")
    assert cli.main(["sft", *args, "data.max_lenght=64", "optim.betas=[0.9,0.95]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("ulysses_sequence_parallel_size=2 is not available here" in line for line in err)
    assert any("unknown key data.max_lenght; did you mean data.max_length?" in line for line in err)
    assert any("optim.betas=[0.9, 0.95]: AdamW's betas are (0.9, 0.999) here" in line for line in err)
    assert len([line for line in err if "config error" in line]) == 3  # every problem, at once


def test_multiturn_script_without_sequence_parallelism_runs_a_step(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = multiturn_script(home, tmp_path / "run", sp=False)
    cfg, _ = verl_config.load(None, args, tree="sft")
    assert cfg.algorithm.sft_columns == {"messages": "messages"} and cfg.actor.micro_batch_size == 4
    assert cli.main(["sft", *args]) == 0
    assert [s for s in steps(tmp_path / "run") if s.get("step") == 1]


def test_sft_rows_longer_than_max_length_are_refused_as_verl_does(home, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = peft_script(home, tmp_path / "run") + ["data.max_length=8"]
    assert cli.main(["sft", *args]) == 2
    err = capsys.readouterr().err
    assert "SFT row 0:" in err and "more than algorithm.sft_max_length=8" in err
    cfg, _ = verl_config.load(None, args + ["data.truncation=right"], tree="sft")
    assert cfg.algorithm.sft_truncation == "right"
    with pytest.raises(ConfigProblems, match="data.truncation=left is not available for SFT here"):
        verl_config.load(None, args + ["data.truncation=left"], tree="sft")


def test_sft_config_name_and_hydra_forms(home, tmp_path):
    cfg, _ = verl_config.load(None, [f"model.partial_pretrain={home}/tiny", "++optim.lr=2e-5"],
                              config_name="sft_trainer")
    assert cfg.algorithm.type == "sft" and cfg.actor.lr == pytest.approx(2e-5)
