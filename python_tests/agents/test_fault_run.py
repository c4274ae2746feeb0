"""End to end: a tool-calling training run (tiny model, HF engine, CPU, the trainer's SIGTERM handler
installed) in which a tool times out, a tool forks processes that would sleep for ten minutes, and an
environment step runs past rollout.multi_turn.env_timeout_s. The run must end on its own, and leave
no process behind: no tool worker, nothing in a worker's process group, no process a tool started,
no guardian (looked for in /proc after it exits)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import agent_faults
from agent_faults import alive, pids_in_groups, wait_gone

SUPPORT = Path(agent_faults.__file__).parent

RUN = """
import json, sys
sys.path.insert(0, {support!r})
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.agents import isolation
from verl_fast.records.generation import pad_completions
from verl_fast.rollout.hf_engine import HFGenerateEngine
from verl_fast.trainer.rl_trainer import RLTrainer

HARNESS = {harness!r}
SCRIPT = {{  # a task's first model turn; every later turn makes no call (the episode ends)
    "A": '<tool_call>{{"name": "stall", "arguments": {{"seconds": 30}}}}</tool_call>',  # past the tool's 1 s
    "B": '<tool_call>{{"name": "spawn_sleepers", "arguments": {{"count": 2}}}}</tool_call>',
    "C": '<tool_call>{{"name": "stall", "arguments": {{"seconds": 0.9}}}}</tool_call>' * 4,  # a step past 2.5 s
}}
workers = []
start = isolation.Worker.__init__
def recording(self, *a, **k):
    start(self, *a, **k)
    workers.append(self.pid)
isolation.Worker.__init__ = recording


class Scripted(HFGenerateEngine):
    # the tiny model decodes each turn; the first turn of task X is then replaced by SCRIPT[X]
    def generate(self, prompts, sampling):
        out = super().generate(prompts, sampling)
        turns = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            first = text.count("<|im_start|>assistant") == 1
            task = text.split("Task ")[-1][:1]
            turns.append(self.tokenizer(SCRIPT[task] if first else "done")["input_ids"] + [self.tokenizer.eos_token_id])
        lp = None if out.logprobs is None else [[0.0] * len(t) for t in turns]
        return pad_completions(turns, lp, out.prompt_index.tolist(), self.tokenizer.pad_token_id,
                               ["" for _ in turns], ["stop"] * len(turns))


path = save_tiny_model({tmp!r} + "/tiny", family="qwen2")
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
cfg = {{"rollout": {{"type": "hf", "n": 2, "max_new_tokens": 1024,
                    "multi_turn": {{"tools": [HARNESS + ":stall", HARNESS + ":spawn_sleepers"], "tool_timeout_s": 1.0,
                                   "env_timeout_s": 2.5, "tool_workers": 4, "max_turns": 2, "max_tokens_per_turn": 8,
                                   "tool_format": "hermes"}}}},
       "reward_fn": {{"type": "gsm8k"}}, "algorithm": {{"type": "grpo"}},
       "trainer": {{"total_steps": 1, "train_batch_size": 3, "output_dir": {tmp!r} + "/run", "progress_bar": False,
                   "plot": False, "device": "cpu", "save_freq": 1}}}}
trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg,
                    rollout_engine=Scripted(model, tok, fast_decode="off"))
rows = [{{"prompt": f"Task {{t}}: call your tool.", "ground_truth": "1"}} for t in "ABC"]
history = trainer.fit(rows)
print(json.dumps({{"workers": workers, "guardian": isolation.Guardian.get().process.pid,
                  "metrics": {{k: v for k, v in history[-1].items() if k.startswith("multi_turn/")}}}}), flush=True)
"""


def test_a_run_with_a_timed_out_tool_a_forking_tool_and_a_hanging_environment_ends_and_leaves_nothing(tmp_path):
    spawned_file = tmp_path / "spawned"
    script = RUN.format(support=str(SUPPORT), harness=agent_faults.__file__, tmp=str(tmp_path))
    env = {**os.environ, "VERL_FAST_FAULTS_SPAWNED": str(spawned_file)}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    m = report["metrics"]
    assert m["multi_turn/tool_timeouts"] >= 2 and m["multi_turn/env_timeouts"] >= 2, m
    spawned = [int(p) for p in spawned_file.read_text().split()]
    assert len(spawned) == 4  # two samples of task B, two processes each
    groups = set(report["workers"])
    left = wait_gone(report["workers"] + spawned + [report["guardian"]], 5.0)
    assert not left and not pids_in_groups(groups), f"left behind: {alive(left)} {pids_in_groups(groups)}"
