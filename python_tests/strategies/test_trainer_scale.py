"""RLTrainer over several processes: plain HF models sharded from the config (FSDP2, FSDP1), the
same training at world size 2 as at world size 1, the critic reduced, multi-node launch, NCCL.

The CPU tests run 2 gloo processes with torchrun; trainer_scale_worker.py trains each scenario on a
scripted rollout (the same sequences at every world size) and saves metrics and gathered weights.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import save_tiny_model
from ports import free_port

HERE = Path(__file__).resolve().parents[1] / "support"  # the workers
WORKER = HERE / "trainer_scale_worker.py"
# Same data, same math: what differs is the order of float sums (micro-batches, ranks, padding).
# Seen: 1e-6 on the weights after 3 AdamW steps at lr 1e-3, 1e-7 relative on the metrics.
WEIGHT_ATOL = 2e-5
METRIC_RTOL = 1e-4
METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl", "actor/grad_norm", "critic/vf_loss", "reward/mean")


def torchrun(args, nproc=2, extra=(), env=None, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *extra, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE,
                            env={**os.environ, **(env or {})})


def finish(procs, timeout=600):
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-4000:] for o in outs)
    return outs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """World 1 (grpo, ppo) and world 2 (those plus fsdp1 and bf16 mixed precision), run side by side."""
    root = tmp_path_factory.mktemp("scale")
    actor = save_tiny_model(root / "actor", family="qwen2")
    critic = save_tiny_model(root / "critic", family="llama", seed=1)  # another family than the actor
    (root / "w1").mkdir()
    (root / "w2").mkdir()
    one = subprocess.Popen([sys.executable, str(WORKER), str(root / "w1"), str(actor), str(critic), "grpo", "ppo",
                            "grpo_corrected"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE)
    two = torchrun([str(WORKER), str(root / "w2"), str(actor), str(critic), "grpo", "ppo", "ppo_prewrapped",
                    "grpo_fsdp1", "grpo_options", "grpo_resharded", "grpo_packed", "grpo_corrected"],
                   extra=("--master_port", str(free_port())))
    finish([one, two])

    def load(world, scenario, rank=0):
        return torch.load(root / f"w{world}" / f"{scenario}.rank{rank}.pt", weights_only=False)

    return load


def assert_same_training(single, multi, models=("actor",), weight_atol=WEIGHT_ATOL):
    assert len(single["history"]) == len(multi["history"]) == 3
    for step, (a, b) in enumerate(zip(single["history"], multi["history"])):
        for key in METRICS:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=METRIC_RTOL, abs=1e-6), (step, key, a[key], b[key])
    for model in models:
        assert single[model].keys() == multi[model].keys()
        for name, value in single[model].items():
            diff = (value - multi[model][name]).abs().max().item()
            assert diff <= weight_atol, (model, name, diff)


def assert_equal_across_ranks(first, second, models):
    for model in models:
        for name, value in first[model].items():
            assert torch.equal(value, second[model][name]), (model, name)


def test_grpo_two_ranks_train_as_one(runs):
    """Plain HF actor -> FSDP2 from the config; the KL reference is built from the actor's shards;
    sequences balanced over ranks, normalisers over all ranks: the same losses and weights."""
    multi = runs(2, "grpo")
    assert multi["kinds"] == {"actor": "fsdp2", "ref": "fsdp2", "critic": None}
    assert runs(1, "grpo")["kinds"]["actor"] is None
    assert_same_training(runs(1, "grpo"), multi)
    assert_equal_across_ranks(multi, runs(2, "grpo", rank=1), ["actor"])
    assert multi["history"][0]["actor/kl"] == 0.0  # the reference built from the shards is the actor, exactly
    assert multi["history"][-1]["actor/kl"] > 0


def test_rollout_correction_from_the_update_trains_as_one_on_two_ranks(runs):
    """One mini-batch, one epoch: no old-log-prob pass; each micro-batch's weights come from the
    update's forward. The weights' spread is a token mean over every rank's micro-batches (the max:
    the largest of them) and the training is world 1's."""
    single, multi = runs(1, "grpo_corrected"), runs(2, "grpo_corrected")
    assert_same_training(single, multi)
    for a, b in zip(single["history"], multi["history"]):
        assert 0 < a["rollout_correction/is_capped_fraction"] < 1  # the weights spread: some capped, some not
        assert a["rollout_correction/is_weight_max"] == pytest.approx(3.0)
        for key in ("is_weight_mean", "is_capped_fraction", "mismatch_kl", "is_weight_max"):
            key = f"rollout_correction/{key}"
            assert b[key] == pytest.approx(a[key], rel=METRIC_RTOL), (key, a[key], b[key])


def test_ppo_two_ranks_train_as_one_critic_reduced(runs):
    """The critic (a value head on another family's backbone) is sharded too: its gradients are
    averaged over ranks, and GAE advantages are whitened over every rank's tokens."""
    multi = runs(2, "ppo")
    assert multi["kinds"]["critic"] == "fsdp2"
    assert_same_training(runs(1, "ppo"), multi, models=("actor", "critic"))
    assert_equal_across_ranks(multi, runs(2, "ppo", rank=1), ["actor", "critic"])


def test_parameters_gathered_once_or_per_micro_batch_train_the_same(runs):
    """``unsharded_accumulation``: the micro-batches of a step on parameters gathered once (auto,
    "grpo") or gathered and reduced per micro-batch ("off"): the same training as one process."""
    assert runs(2, "grpo")["gathered_once"] and not runs(2, "grpo_resharded")["gathered_once"]
    assert max(h["micro_batches"] for h in runs(2, "grpo")["history"]) >= 2
    assert_same_training(runs(1, "grpo"), runs(2, "grpo_resharded"))


def test_packed_rows_on_two_ranks_train_as_one_padded_process(runs):
    """``actor.use_remove_padding`` on FSDP2 ranks (each packs its own rows, each group's prompt once;
    actor, reference and update): the same training as one process on padded rows."""
    multi = runs(2, "grpo_packed")
    assert multi["packs"] and not runs(1, "grpo")["packs"]  # on the CPU only when asked for
    # packed sequences sum in another order than padded rows: seen up to 1.1e-4 on rarely used embedding rows
    # in a full-suite run (AdamW's step, lr 1e-3, is about as large for a near-zero gradient as for a large
    # one); a wrong attention or layout moves the weights by ~lr a step, 3e-3 over the three steps
    assert_same_training(runs(1, "grpo"), multi, weight_atol=3e-4)


def test_user_wrapped_models_used_as_they_are(runs):
    """An actor and a critic backbone the user wrapped with FSDP2 are not re-wrapped; the value head
    the trainer adds on the critic gets a root FSDP2 group, so its gradients are reduced too."""
    multi = runs(2, "ppo_prewrapped")
    assert multi["same_actor"] and multi["kinds"]["critic"] == "fsdp2"
    assert_same_training(runs(1, "ppo"), multi, models=("actor", "critic"))


def test_fsdp1_strategy_trains_as_one(runs):
    multi = runs(2, "grpo_fsdp1")
    assert multi["kinds"] == {"actor": "fsdp1", "ref": "fsdp1", "critic": None}
    assert multi["history"][0]["actor/kl"] == 0.0
    assert_same_training(runs(1, "grpo"), multi)


def test_bf16_mixed_precision_and_checkpointing(runs):
    """bf16 parameters with fp32 gradient reduction and activation checkpointing: close to the fp32
    run (bf16 rounding), not equal to it."""
    single, multi = runs(1, "grpo"), runs(2, "grpo_options")
    for a, b in zip(single["history"], multi["history"]):
        assert b["actor/entropy"] == pytest.approx(a["actor/entropy"], rel=1e-3)
        assert b["actor/kl"] == pytest.approx(a["actor/kl"], rel=0.05, abs=1e-4)
    diffs = [(v - multi["actor"][k]).abs().max().item() for k, v in single["actor"].items()]
    assert 0 < max(diffs) < 0.02, max(diffs)


def test_two_nodes_with_the_cli(tmp_path):
    """`torchrun --nnodes 2` with c10d rendezvous: two agents (one process each) on 127.0.0.1 run
    `-m verl_fast train --config c.yaml` to the end."""
    model = save_tiny_model(tmp_path / "model", family="qwen2")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {a}?", "data_source": "toy",
                                        "reward_model": {"ground_truth": str(2 * a)}}) + "\n" for a in range(8)))
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "actor": {"model_name": str(model), "lr": 1e-3, "use_kl_loss": True},
        "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
        "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
        "trainer": {"total_steps": 2, "train_batch_size": 2, "dataset": str(data), "device": "cpu",
                    "output_dir": str(tmp_path / "run"), "progress_bar": False, "plot": False}}))
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [torchrun(["-m", "verl_fast", "train", "--config", str(config)], nproc=1,
                       extra=("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                              "--rdzv-id", "scale-test"))
              for _ in range(2)]
    finish(agents)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("case", ["grpo_kl", "ppo_bf16_offload", "grpo_kl_offload"])
def test_nccl_two_gpus(tmp_path, case):
    """2 ranks on NCCL through the CLI: every collective on the GPU, actor (and critic) sharded with
    FSDP2 from the config, the reference built from the actor; a few steps to the end."""
    model = save_tiny_model(tmp_path / "model", family="qwen2")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {a}?", "data_source": "toy",
                                        "reward_model": {"ground_truth": str(2 * a)}}) + "\n" for a in range(8)))
    cfg = {"actor": {"model_name": str(model), "lr": 1e-3, "use_dynamic_bsz": True, "max_token_len_per_gpu": 64},
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": 8},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 3, "train_batch_size": 4, "dataset": str(data), "device": "cuda",
                       "output_dir": str(tmp_path / "run"), "progress_bar": False, "plot": False}}
    if case.startswith("grpo_kl"):  # the reference built from the actor's (offloaded) shards
        cfg["actor"].update(use_kl_loss=True, cpu_offload=case.endswith("offload"))
    else:
        cfg["algorithm"] = {"type": "ppo"}
        cfg["critic"] = {"model_name": str(model), "mixed_precision": "bfloat16", "cpu_offload": True}
        cfg["actor"].update(mixed_precision="bfloat16", cpu_offload=True, gradient_checkpointing=True)
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    finish([torchrun(["-m", "verl_fast", "train", "--config", str(tmp_path / "c.yaml")],
                     extra=("--master_port", str(free_port())), env=env)])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["actor/grad_norm"])) for r in rows)


def test_strategy_errors_name_the_key(tmp_path):
    """Combinations that cannot work fail at start-up, naming the key and what to use instead."""
    from verl_fast import config as config_mod
    from verl_fast.strategies.sharding import Sharding

    cfg = config_mod.from_dict({"actor": {"strategy": "fsdp2"}, "critic": {"mixed_precision": "bfloat16"}})
    with pytest.raises(ValueError, match=r"actor.strategy=fsdp2 needs torch.distributed.*actor.strategy=none"):
        Sharding.from_config(cfg.actor, "actor", world=1)
    with pytest.raises(ValueError, match=r"critic.mixed_precision is not supported with critic.strategy=none"):
        Sharding.from_config(cfg.critic, "critic", world=1)
    with pytest.raises(ValueError, match=r"actor.strategy=none is not supported with 2 processes"):
        Sharding.from_config(config_mod.from_dict({"actor": {"strategy": "none"}}).actor, "actor", world=2)
    with pytest.raises(ValueError, match=r"critic.strategy=megatron is not supported with actor.strategy=auto.*"
                                         r"use actor.strategy=megatron"):
        config_mod.from_dict({"critic": {"strategy": "megatron"}})
    with pytest.raises(ValueError, match=r"critic.mixed_precision is not supported with critic.strategy=megatron"):
        config_mod.from_dict({"actor": {"strategy": "megatron"},
                              "critic": {"strategy": "megatron", "mixed_precision": "bfloat16"}})
    with pytest.raises(ValueError, match=r"actor.strategy must be one of"):
        config_mod.from_dict({"actor": {"strategy": "ddp"}})
    assert Sharding.from_config(config_mod.from_dict({}).actor, "actor", world=1).strategy == "none"


def test_megatron_model_refusals_name_the_key():
    """What the Megatron model mapping cannot build fails before megatron-core is touched."""
    from tiny_models import tiny_config

    from verl_fast.strategies.megatron.gpt_model import Parallel, model_spec

    with pytest.raises(ValueError, match=r"actor.expert_model_parallel_size=2 needs a mixture-of-experts model"):
        model_spec(tiny_config("qwen2"), torch.float32, "actor", Parallel(ep=2))
    with pytest.raises(ValueError, match=r"expert_model_parallel_size > 1 is not supported with tensor_model"):
        model_spec(tiny_config("qwen3_moe"), torch.float32, "actor", Parallel(tp=2, ep=2))
    with pytest.raises(ValueError, match=r"dense layers among the MoE layers .*mlp_only_layers"):
        model_spec(tiny_config("qwen2_moe", mlp_only_layers=[1]), torch.float32, "actor", Parallel())
    with pytest.raises(ValueError, match=r"critic.strategy=megatron supports model_type .* got 'mixtral'"):
        model_spec(tiny_config("mixtral"), torch.float32, "critic", Parallel())
    assert model_spec(tiny_config("qwen3_moe"), torch.float32, "actor", Parallel(ep=2)).num_experts == 4
