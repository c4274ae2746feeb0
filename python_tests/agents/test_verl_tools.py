"""verl's multi-turn keys and tools: the tool YAML (class_name, config, tool_schema), a user's tool
class in verl's interface (async create / execute / calc_reward / release) through the adapter, verl's
example GSM8K tool, the keys that cannot be honoured refused in one line, and verl's sglang_multiturn
example's command line (its engine changed to hf) running a step."""

import json
import textwrap

import pandas as pd
import pytest

from tiny_models import save_tiny_model
from verl_fast.agents import verl_tools
from verl_fast.cli import main as cli
from verl_fast.config import verl_config
from verl_fast.config.verl_config import ConfigProblems
from verl_fast.data import PromptRow
from verl_fast.trainer import catalog

catalog.register()
MT = "actor_rollout_ref.rollout.multi_turn"
SCHEMA = """\
    tool_schema:
      type: function
      function:
        name: {name}
        description: {description}
        parameters:
          type: object
          properties:
            {arg}:
              type: string
              description: the {arg}
          required: [{arg}]
"""


def write_tools(tmp_path):
    (tmp_path / "my_tools.py").write_text(textwrap.dedent("""\
        from verl.tools.base_tool import BaseTool
        from verl.tools.schemas import ToolResponse

        class Echo(BaseTool):
            calls = []

            def __init__(self, config, tool_schema):
                super().__init__(config, tool_schema)
                self.prefix = config["prefix"]
                self.state = {}

            async def create(self, instance_id=None, secret="none", **kwargs):
                self.state[instance_id] = secret
                return instance_id, ToolResponse()

            async def execute(self, instance_id, parameters, **kwargs):
                Echo.calls.append(("execute", parameters))
                return ToolResponse(text=self.prefix + parameters["text"] + "/" + self.state[instance_id]), 0.5, {}

            async def calc_reward(self, instance_id, **kwargs):
                return 1.0

            async def release(self, instance_id, **kwargs):
                Echo.calls.append(("release", instance_id))
                del self.state[instance_id]
        """))
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n"
                    f"  - class_name: {tmp_path / 'my_tools.py'}:Echo\n    config:\n      prefix: '>'\n"
                    + SCHEMA.format(name="echo", description="echoes", arg="text")
                    + '  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"\n    config:\n      type: native\n'
                    + SCHEMA.format(name="calc_gsm8k_reward", description="scores an answer", arg="answer"))
    return path


def row(truth="72"):
    extra = {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}},
                              "echo": {"create_kwargs": {"secret": "s3"}}}}
    return PromptRow(prompt_ids=[1], prompt_text="q", ground_truth=truth, data_source="openai/gsm8k",
                     extra_info=extra, columns={"prompt": [{"role": "user", "content": "What is 8 x 9?"}]})


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_user_tool_class_and_verls_gsm8k_tool_through_the_adapter(tmp_path):
    path = str(write_tools(tmp_path))
    schemas = verl_tools.VerlToolEnvironment.tool_schemas(path)
    assert [s["function"]["name"] for s in schemas] == ["echo", "calc_gsm8k_reward"]
    env = verl_tools.VerlToolEnvironment(path, max_parallel_calls=2, max_response_chars=64)
    messages = env.reset(row())
    assert messages == [{"role": "user", "content": "What is 8 x 9?"}]
    out = env.step({"role": "assistant", "content": call("echo", text="hi") + call("calc_gsm8k_reward", answer="71")})
    assert [m["content"] for m in out.messages] == [">hi/s3", "Current parsed answer='71' reward=0.0"]
    out = env.step({"role": "assistant", "content": call("calc_gsm8k_reward", answer="72") + call("nope")})
    assert out.messages[0]["content"] == "Current parsed answer='72' reward=1.0"
    assert out.messages[1]["content"].startswith("error: no tool named 'nope'")
    done = env.step({"role": "assistant", "content": "The answer is 72."})
    assert done.done and not env.instances  # released
    echo = env.tools["echo"][0]
    assert ("release", next(c[1] for c in type(echo).calls if c[0] == "release")) in type(echo).calls
    assert env.metrics()["tool_calls"] == 4 and env.metrics()["tool_errors"] == 1
    # echo 0.5; gsm8k: -0.05 for a call that does not improve the score (0 -> 0), then 0 (0 -> 1)
    assert env.metrics()["tool_reward"] == pytest.approx(0.5 - 0.05 + 0.0)


def test_the_tool_yaml_and_class_checked_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools:\n  - class_name: x.Y\n    tool_schema: {type: function}\n")
    with pytest.raises(ValueError, match=r"bad.yaml: tools\[0\]: needs tool_schema in OpenAI's function form"):
        verl_tools.read_tool_config(str(bad))
    (tmp_path / "plain.py").write_text("class NotATool:\n    pass\n")
    spec = verl_tools.ToolSpec(f"{tmp_path}/plain.py:NotATool", {}, {"function": {"name": "t"}})
    with pytest.raises(ValueError, match="not a tool class in verl's interface"):
        verl_tools.tool_class(spec, "t.yaml")
    spec = verl_tools.ToolSpec("verl.tools.sandbox_fusion_tools.SandboxFusionTool", {}, {"function": {"name": "code"}})
    with pytest.raises(ValueError, match="class_name verl.tools.sandbox_fusion_tools.SandboxFusionTool: .*verl is "
                                         "not installed"):
        verl_tools.tool_class(spec, "t.yaml")


def test_verl_multi_turn_keys_honoured_or_refused(tmp_path):
    path = write_tools(tmp_path)
    base = ["actor_rollout_ref.model.path=m", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]
    cfg, _ = verl_config.load(None, base + [f"{MT}.enable=true", f"{MT}.tool_config_path={path}",
                                            f"{MT}.max_assistant_turns=3", f"{MT}.max_tool_response_length=100"])
    mt = cfg.rollout.multi_turn
    assert mt["environment"] == "verl_fast.agents.verl_tools:VerlToolEnvironment" and mt["max_turns"] == 3
    assert mt["environment_kwargs"]["tool_config_path"] == str(path)
    assert mt["environment_kwargs"]["max_response_chars"] == 100
    off, _ = verl_config.load(None, base + [f"{MT}.tool_config_path={path}"])
    assert off.rollout.multi_turn is None  # verl runs single-turn unless multi_turn.enable
    with pytest.raises(ConfigProblems) as e:
        verl_config.load(None, base + [f"{MT}.enable=true", f"{MT}.interaction_config_path=i.yaml",
                                       f"{MT}.max_user_turns=2"])
    lines = e.value.lines
    assert any(line.startswith(f"{MT}.enable=true needs {MT}.tool_config_path") for line in lines)
    assert any(line.startswith(f"{MT}.interaction_config_path=i.yaml is not available here") for line in lines)
    assert any(line.startswith(f"{MT}.max_user_turns=2 is not available here") for line in lines)


@pytest.fixture
def multiturn_home(tmp_path):
    save_tiny_model(tmp_path / "tiny")
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"index": i, "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": a}},
                                                         "echo": {"create_kwargs": {"secret": "x"}}}}}
            for i, (q, a) in enumerate([("What is 8 x 9?", "72"), ("What is 2 + 3?", "5")])]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    config = tmp_path / "config"
    config.mkdir()
    (config / "gsm8k_multiturn_grpo.yaml").write_text(textwrap.dedent("""\
        hydra:
          searchpath:
            - file://verl/trainer/config
        defaults:
          - ppo_trainer
          - _self_
        data:
          max_prompt_length: 1024
          max_response_length: 1024
          train_batch_size: 256
          return_raw_chat: True
        actor_rollout_ref:
          hybrid_engine: True
          rollout:
            name: sglang
            multi_turn:
              enable: True
              max_assistant_turns: 5
        """))
    return tmp_path


def test_sglang_multiturn_example_runs_a_step_with_the_hf_engine(multiturn_home, monkeypatch):
    """examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh's shape: --config-path / --config-name,
    only paths, sizes and the engine (sglang -> hf) changed."""
    home = multiturn_home
    monkeypatch.chdir(home)
    tools = write_tools(home)
    args = [f"--config-path={home / 'config'}", "--config-name=gsm8k_multiturn_grpo",
            "algorithm.adv_estimator=grpo", "data.train_batch_size=2", "data.max_prompt_length=512",
            "data.max_response_length=24", "data.filter_overlong_prompts=True", "data.truncation=error",
            "data.return_raw_chat=True", f"actor_rollout_ref.model.path={home / 'tiny'}",
            "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.mode=async", "trainer.critic_warmup=0",
            "trainer.logger=console", "trainer.save_freq=-1", "trainer.test_freq=20",
            f"data.train_files={home / 'train.parquet'}", f"data.val_files={home / 'train.parquet'}",
            f"{MT}.tool_config_path={tools}",
            "trainer.total_training_steps=1", f"trainer.default_local_dir={home / 'run'}"]
    cfg, _ = verl_config.load(None, args[2:], config_path=str(home / "config"), config_name="gsm8k_multiturn_grpo")
    assert cfg.rollout.multi_turn["max_turns"] == 5 and cfg.rollout.type == "hf"
    assert cli.main(["train", *args]) == 0
    steps = [json.loads(line) for line in (home / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(s.get("step") == 1 and "reward/mean" in s for s in steps)
