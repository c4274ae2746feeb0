"""The command line's error policy (verl_fast/errors.py) over every refusal case: `verl-fast <command>`
exits 2 with one line on stderr naming the key, file (and line) or function, and never a traceback;
no model loads where the refusal comes before it (the model folders here hold no weights at all).

CASES is also the table of docs/faults.md (with the cases other tests reproduce, in
OTHER_CASES): `python python_tests/package/test_cli_errors.py` rewrites it, and a test checks it is
current."""

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))
from cli_refusal import refusal  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "faults.md"


@dataclass
class Case:
    id: str
    doing: str  # what the user does
    before: str  # what happened before this round
    expect: str  # a regular expression the stderr line matches
    argv: Callable[[Path], List[str]]  # the command line, given a fresh folder to set up


def rows(tmp: Path, text: str = '{"prompt": "1 + 1?", "reward_model": {"ground_truth": "2"}}\n') -> Path:
    path = tmp / "rows.jsonl"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def model_folder(tmp: Path, **config) -> Path:
    """A model folder with a config.json and no weights: every case using it refuses before a load."""
    folder = tmp / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 1024,
                                                    **config}))
    return folder


def train(tmp: Path, *extra: str, dataset: Path = None, model: Path = None) -> List[str]:
    """`verl-fast train` on the CPU with the HF rollout, writing under ``tmp``."""
    return ["train", f"trainer.dataset={dataset or rows(tmp)}", f"actor.model_name={model or model_folder(tmp)}",
            "rollout.type=hf", "reward_fn.type=gsm8k", "trainer.plot=false", "trainer.device=cpu",
            f"trainer.output_dir={tmp / 'run'}", *extra]


def config_file(tmp: Path, text) -> List[str]:
    path = tmp / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return ["train", "--print-config", "--config", str(path)]


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def fifo_config(tmp: Path) -> Path:
    """A model folder whose config.json is a FIFO."""
    (tmp / "fifo_model").mkdir()
    return fifo(tmp / "fifo_model" / "config.json").parent


def linked(path: Path, target: Path) -> Path:
    path.symlink_to(target)
    return path


def with_file(folder: Path, name: str, data: bytes) -> Path:
    (folder / name).write_bytes(data)
    return folder


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def other_run(tmp: Path) -> Path:
    """A run folder (its lock file and a checkpoint) and an output_dir inside its checkpoints."""
    (tmp / "a" / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp / "a" / ".lock").write_text("")
    return tmp / "a" / "checkpoints" / "step_000001" / "b"


def checkpoint_with_state(tmp: Path, step_value) -> Path:
    """A complete checkpoint (a small Linear) whose trainer_state.json says ``step_value``, its
    manifest rewritten to match (so only the state's check can find it)."""
    import zlib

    import torch

    from verl_fast.checkpoint import sharded as checkpoint

    model = torch.nn.Linear(2, 2)
    checkpoint.save(str(tmp / "run"), 1, model, None, torch.optim.SGD(model.parameters(), lr=0.1), {"history": []})
    step = tmp / "run" / "checkpoints" / "step_000001"
    (step / "trainer_state.json").write_text(json.dumps({"step": step_value, "history": []}))
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / "trainer_state.json").read_bytes()
    manifest["files"]["trainer_state.json"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (step / "manifest.json").write_text(json.dumps(manifest))
    return step


SFT_ROW = '{"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}\n'


def fake_demo_model(tmp: Path) -> Path:
    """A cache holding the demo model's folder (its config's 8192 positions, no real weights)."""
    folder = tmp / "cache" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 8192}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    (folder / "model.safetensors").write_bytes(safetensors_bytes(
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4))
    return folder.parent


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)) + "trainer: {}\n"

CASES = [
    Case("yaml_alias_bomb", "a config of 400 bytes whose aliases expand to 9^9 values",
         "--print-config grew past 3.7 GB; a run wrote a 205 MB trainer_state.json",
         r"expands to more than 100,000 values through its aliases", lambda t: config_file(t, BOMB)),
    Case("yaml_duplicate_section", "a config with two `trainer:` sections", "the first silently dropped",
         r"c\.yaml:3: duplicate key 'trainer' \(first at line 1\)",
         lambda t: config_file(t, "trainer: {total_steps: 3}\nactor: {lr: 1.0e-5}\ntrainer: {save_freq: 1}\n")),
    Case("config_not_utf8", "a config file saved as Latin-1", "UnicodeDecodeError traceback",
         r"c\.yaml:2: the config is not UTF-8 text", lambda t: config_file(t, b"actor:\n  lr: 1.0e-5 # \xe9\n")),
    Case("config_fifo", "--config names a FIFO", "waited forever",
         r"the config .*c\.fifo is not a regular file",
         lambda t: ["train", "--print-config", "--config", str(fifo(t / "c.fifo"))]),
    Case("entropy_coeff_huge", "actor.entropy_coeff=1e308", "NaN grad norms, exit 0",
         r"actor\.entropy_coeff must be within float32's range \(\|x\| <= 3\.4e38\), got 1e\+308", lambda t: ["train", "--print-config",
                                                                          "actor.entropy_coeff=1e308"]),
    Case("coefficient_out_of_range", "actor.entropy_coeff=5 (coefficients have ranges: entropy [-1, 1], KL [0, 100])",
         "accepted", r"actor\.entropy_coeff must be <= 1\.0, got 5\.0",
         lambda t: ["train", "--print-config", "actor.entropy_coeff=5"]),
    Case("top_p_zero", "rollout.top_p=0", "passed validation, failed after the model loaded",
         r"rollout\.top_p must be > 0\.0, got 0\.0", lambda t: ["train", "--print-config", "rollout.top_p=0"]),
    Case("max_shard_gb_nan", "`verl-fast export ... --max-shard-gb nan`", "traceback from int(nan)",
         r"--max-shard-gb: 'nan': a shard size in GiB above 0",
         lambda t: ["export", str(t), str(t / "out"), "--max-shard-gb", "nan"]),
    Case("dataset_fifo", "trainer.dataset is a FIFO", "blocked forever", r"dataset .*rows\.jsonl is a FIFO",
         lambda t: train(t, dataset=fifo(t / "rows.jsonl"))),
    Case("jsonl_huge_line", "a JSONL row of one 100 MB line", "grew past 9 GB",
         r"rows\.jsonl:2: a line longer than 16 MiB",
         lambda t: train(t, dataset=rows(t, '{"prompt": "a"}\n{"prompt": "' + "a" * (17 << 20) + '"}\n'))),
    Case("jsonl_bad_json", "a JSONL line that is not JSON", "traceback (after the model loaded)",
         r"rows\.jsonl:2: invalid JSON", lambda t: train(t, dataset=rows(t, '{"prompt": "a"}\n{"prompt": \n'))),
    Case("jsonl_not_utf8", "a JSONL file with a Latin-1 byte", "UnicodeDecodeError traceback, no line",
         r"rows\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)",
         lambda t: train(t, dataset=rows(t, b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n'))),
    Case("row_without_prompt", "a row without `prompt`", "ValueError without file or line",
         r"rows\.jsonl:1: a row needs a 'prompt' field \(verl format\), got keys \['question'\]",
         lambda t: train(t, dataset=rows(t, '{"question": "1 + 1?"}\n'))),
    Case("int_prompt", "a row whose prompt is an int", "ValueError without file or line",
         r"rows\.jsonl:1: prompt must be a string or a non-empty list of chat messages, got int 5",
         lambda t: train(t, dataset=rows(t, '{"prompt": 5}\n'))),
    Case("message_without_content", "chat messages without `content`", "ValueError without file or line",
         r"rows\.jsonl:1: prompt\[0\] must be a chat message with a string 'content'",
         lambda t: train(t, dataset=rows(t, '{"prompt": [{"role": "user", "text": "hi"}]}\n'))),
    Case("reward_model_string", 'a row with `"reward_model": "5"`', "the reward got ground_truth=None",
         r"rows\.jsonl:1: reward_model must be a mapping such as \{\"ground_truth\": ...\}, got '5'",
         lambda t: train(t, dataset=rows(t, '{"prompt": "1 + 4?", "reward_model": "5"}\n'))),
    Case("groundtruth_key", "a row with a `groundtruth` key", "the reward got ground_truth=None",
         r"rows\.jsonl:1: reward_model\.groundtruth: the ground truth's key is reward_model\.ground_truth",
         lambda t: train(t, dataset=rows(t, '{"prompt": "1 + 4?", "reward_model": {"groundtruth": "5"}}\n'))),
    Case("rows_without_ground_truth", "reward_fn.type=gsm8k over rows without a ground truth",
         "every sample scored 0 (reasoning_gym: a traceback after the model loaded)",
         r"rows\.jsonl:2: reward_fn\.type=gsm8k scores against a ground truth, and this row has none",
         lambda t: train(t, dataset=rows(t, '{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": "2 + 2?"}\n'))),
    Case("output_dir_in_other_run", "trainer.output_dir inside another run's checkpoints/",
         "the other run's resume called its checkpoint damaged, and its re-save deleted this run",
         r"lies inside the run .*a's checkpoints folder",
         lambda t: train(t, f"trainer.output_dir={other_run(t)}")),
    Case("lock_held", "a second run on an output_dir in use", "traceback", r"is in use by another run \(PID \d+\)",
         lambda t: train(t)),  # the lock is taken by a helper process in the test
    Case("chat_template_link", "the model folder's chat_template.jinja links to a file outside it",
         "its text became the chat template, copied into the checkpoint, its export and a Hub upload",
         r"chat_template\.jinja is a symbolic link to .*secret\.txt, outside the model folder",
         lambda t: train(t, model=linked(model_folder(t) / "chat_template.jinja", with_file(t, "secret.txt", b"x")
                                         / "secret.txt").parent)),
    Case("safetensors_dev_zero", "model.safetensors is a link to /dev/zero", '"no file named model.safetensors"',
         r"model\.safetensors is a symbolic link to /dev/zero, outside the model folder",
         lambda t: train(t, model=linked(model_folder(t) / "model.safetensors", Path("/dev/zero")).parent)),
    Case("safetensors_empty_header", "model.safetensors with an empty header", "trained from random weights, exit 0",
         r"model\.safetensors holds no tensors \(an empty header\)",
         lambda t: train(t, model=with_file(model_folder(t), "model.safetensors", safetensors_bytes({})))),
    Case("safetensors_cut_short", "model.safetensors cut short", "traceback from safetensors",
         r"model\.safetensors: tensor w lies outside the file's 4 data bytes",
         lambda t: train(t, model=with_file(model_folder(t), "model.safetensors", safetensors_bytes(
             {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 4)))),
    Case("config_json_fifo", "the model's config.json is a FIFO", "blocked forever", r"config\.json is a FIFO",
         lambda t: train(t, model=fifo_config(t))),
    Case("tokenizer_config_not_json", "tokenizer_config.json is not JSON", "traceback from transformers",
         r"tokenizer_config\.json is not JSON",
         lambda t: train(t, model=with_file(model_folder(t), "tokenizer_config.json", b"{not json"))),
    Case("max_new_tokens_past_context", "rollout.max_new_tokens=1000000000 on a 1024-position model",
         "never gave a step", r"rollout\.max_new_tokens=1000000000 does not fit actor\.model_name's context of 1024",
         lambda t: train(t, "rollout.max_new_tokens=1000000000")),
    Case("flash_attention_missing", "actor.attn_implementation=flash_attention_2 without flash-attn", "traceback",
         r"actor\.attn_implementation=flash_attention_2 needs the flash-attn package",
         lambda t: train(t, "actor.attn_implementation=flash_attention_2")),
    Case("export_hostile_state", "`verl-fast export` of a checkpoint whose trainer_state.json says step 1e18",
         'reported "done"; step -5 / "abc": ZeroDivisionError, ValueError',
         r"trainer_state\.json: step must be 1, the folder's step, got 1e\+18",
         lambda t: ["export", str(checkpoint_with_state(t, 1e18)), str(t / "out")]),
    Case("resume_from_hostile_state", "trainer.resume_from a checkpoint whose trainer_state.json says step \"abc\"",
         "ValueError traceback (invalid literal for int())",
         r"trainer\.resume_from=.*step_000001: .*trainer_state\.json: step must be 1, the folder's step, got 'abc'",
         lambda t: train(t, f"trainer.resume_from={checkpoint_with_state(t, 'abc')}", f"trainer.output_dir={t / 'b'}")),
    Case("export_missing", "`verl-fast export` of a folder without checkpoints", "traceback",
         r"no complete checkpoint there", lambda t: ["export", str(t), str(t / "out")]),
    Case("convert_missing", "`verl-fast convert` of a folder that is no Megatron checkpoint", "traceback",
         r"checkpoint_path '.*none' is not a directory", lambda t: ["convert", str(t / "none"), str(t / "out")]),
    Case("dataset_kwargs_unknown_key", "an unknown key in trainer.dataset_kwargs (a reasoning_gym task)",
         "TypeError traceback", r"dataset_kwargs\.bogus: reasoning_gym task chain_sum has no such option; its options: "
         r"allow_negation, max_digits", lambda t: train(t, "trainer.dataset_kwargs.bogus=1",
                                                        dataset="reasoning_gym:chain_sum")),
    Case("sft_messages_empty", "an SFT row whose `messages` is []", "traceback from transformers",
         r"rows\.jsonl:2: messages must be a non-empty list of chat messages, got list \[\]",
         lambda t: train(t, "algorithm.type=sft", dataset=rows(t, SFT_ROW + '{"messages": []}\n'))),
    Case("sft_messages_null_content", "an SFT message with null content", "trained on the text 'None'",
         r"rows\.jsonl:1: messages\[0\] must be a chat message with a string 'content'",
         lambda t: train(t, "algorithm.type=sft", dataset=rows(
             t, '{"messages": [{"role": "user", "content": null}, {"role": "assistant", "content": "4"}]}\n'))),
    Case("sft_messages_strings", "SFT `messages` as strings instead of dicts", "AttributeError traceback",
         r"rows\.jsonl:1: messages\[0\] must be a chat message with a string 'content' .*got 'hi'",
         lambda t: train(t, "algorithm.type=sft", dataset=rows(t, '{"messages": ["hi", "there"]}\n'))),
    Case("max_new_tokens_default_engine", "rollout.max_new_tokens=1000000000 with the default model and engine "
         "(vLLM where installed)", "vLLM's pydantic ValidationError traceback", r"rollout\.max_new_tokens=1000000000 "
         r"does not fit actor\.model_name's context of 8192", lambda t: [
             "train", "rollout.max_new_tokens=1000000000", "trainer.device=cpu", f"trainer.output_dir={t / 'run'}"]),
    Case("total_epochs_empty", "`+trainer.total_epochs=` (no value) on the command line", "accepted and ignored",
         r"trainer\.total_epochs= gives no value \(null\), and trainer\.num_epochs needs one",
         lambda t: ["train", "--print-config", "+trainer.total_epochs="]),
    Case("tool_workers_huge", "rollout.multi_turn.tool_workers=100000", "accepted (a process each)",
         r"rollout\.multi_turn\.tool_workers must be <= 256, got 100000",
         lambda t: ["train", "--print-config", "rollout.multi_turn.tool_workers=100000"]),
    Case("async_workers_huge", "trainer.async_workers=100000", "accepted (a process each)",
         r"trainer\.async_workers must be <= 64, got 100000",
         lambda t: ["train", "--print-config", "trainer.async_workers=100000"]),
]

# cases other tests reproduce (a step must run, or no command line reaches them): (what the user does,
# before, after, test)
OTHER_CASES = [
    ("four clients send a byte every 0.3 s to the metrics endpoint", "the endpoint stopped answering (the "
     "5 s timeout was per read)", "each request has a whole-request deadline, read in the acceptor; scrapes answered",
     "python_tests/metrics/test_metrics_server.py::test_slow_clients_cannot_block_the_endpoint"),
    ("the only checkpoint is damaged, and the run saves that step again", "the old folder (its intact "
     "model.safetensors) was deleted", "set aside as step_N.damaged, named in a warning",
     "python_tests/trainer/test_bad_input.py::test_a_damaged_checkpoint_is_set_aside_never_deleted"),
    ("trainer_state.json with step 1e18 / -5 / \"abc\" / history 5", "\"done\", ZeroDivision, ValueError, "
     "TypeError", "the checkpoint is damaged, naming the file and the key; the previous one is resumed",
     "python_tests/trainer/test_bad_input.py::test_hostile_trainer_states_are_damaged_checkpoints"),
    ("trainer.overwrite=true over a folder holding the user's own wandb/", "wandb/ deleted",
     "kept: overwrite removes the loggers' folders only where a run recorded creating them",
     "python_tests/trainer/test_bad_input.py::test_overwrite_keeps_a_wandb_folder_the_run_did_not_write"),
    ("kill -9 during `verl-fast export --overwrite`", "a hidden .DIR.tmp-XXXXXXXX folder left forever",
     "removed by the next export of DIR (one still being written is locked and left alone)",
     "python_tests/trainer/test_bad_input.py::test_a_killed_exports_temporary_folder_is_removed_by_the_next"),
    ("a reward calls sys.exit(3)", "exit 0", "the last complete step checkpointed, exit 3",
     "python_tests/trainer/test_bad_input.py::test_a_reward_calling_sys_exit_ends_with_its_code"),
    ("a reward returns 1e308", "passed the finite check, inf in float32, traceback",
     "refused naming the function and the sample",
     "python_tests/trainer/test_bad_input.py::test_rewards_beyond_float32_are_refused"),
    ("a sequence-classification reward model without pad_token_id", "\"Cannot handle batch sizes > 1 if no "
     "padding token is defined\"", "pads with its tokenizer's pad (EOS when none)",
     "python_tests/trainer/test_bad_input.py::test_a_reward_model_without_pad_token_id_scores_batches"),
    ("RLTrainer(ref_model=...) with another vocabulary", "IndexError", "one line naming both sizes",
     "python_tests/trainer/test_bad_input.py::test_a_reference_of_another_vocabulary_is_refused"),
    ("model.safetensors lacking some of the model's tensors", "trained from random weights, exit 0",
     "refused naming the model and the missing tensors",
     "python_tests/trainer/test_bad_input.py::test_weights_missing_from_the_folder_are_refused"),
    ("examples/moe with actor.routing_replay=true (gradient checkpointing on)", "CheckpointError (61 vs 59 "
     "tensors saved)", "trains: the backward's recompute routes as the forward did",
     "python_tests/models/test_routing.py::test_routing_replay_under_gradient_checkpointing"),
    ("RLTrainer.fit(rows) with `\"reward_model\": \"5\"` or a `groundtruth` key", "the reward got "
     "ground_truth=None", "refused naming the row and the key",
     "python_tests/trainer/test_bad_input.py::test_ground_truth_in_the_wrong_place_is_refused_for_rows_given_in_python"),
    ("trainer.overlong_prompts=error with a long prompt", "ValueError without file or line",
     "names the row's file:line", "python_tests/trainer/test_bad_input.py::test_an_overlong_prompt_names_its_line"),
    ("the disk fills while writing a checkpoint or export", "no path; \"155,723,856 bytes needed, 285,097,984 "
     "free\"", "names the path, with sizes in KiB / MiB / GiB",
     "python_tests/trainer/test_bad_input.py::test_disk_full_names_the_path_with_human_sizes"),
    ("ranks given another trainer.output_dir each (a path built per rank, a node's local disk)",
     "the checkpoint was published with a file marked unreadable; every resume called it damaged and started "
     "from the initial weights", "the save stops on every rank: `…config.json: No such file or directory on rank 1, "
     "which checksums it: every rank must write to and read from the same checkpoint folder`",
     "python_tests/checkpoint/test_checkpoint.py::test_ranks_writing_into_folders_of_their_own_are_refused_at_the_save"),
    ("the Hub upload fails after training (no network)", "traceback (the checkpoint kept)",
     "one line naming hub_model_id and the folder, the checkpoint kept",
     "python_tests/trainer/test_bad_input.py::test_a_failed_hub_upload_is_one_line_and_keeps_the_checkpoint"),
    ("trainer.loggers has wandb without the package", "\"trainer.loggers has wandb needs wandb is not installed\"",
     "\"trainer.loggers has wandb, which needs the wandb package: pip install wandb ...\"",
     "python_tests/trainer/test_run_dir.py::test_precheck_names_the_busy_port_the_bad_folder_and_the_dataset"),
    ("a tool call times out during a run", "the run never exited: a replaced worker took the trainer's SIGTERM "
     "handler, and exit waited on it", "workers take the default SIGTERM; exit waits on none",
     "python_tests/agents/test_tool_faults.py::test_a_run_whose_tool_timed_out_exits_on_its_own"),
    ("a model turn whose tool call nests ~1,100 brackets", "RecursionError out of the rollout",
     "a failed call the model reads, counted in multi_turn/tool_calls_malformed",
     "python_tests/agents/test_parser_faults.py::test_a_degenerate_call_is_a_failed_call_in_the_trajectory_and_a_metric"),
    ("a tool returns a lone surrogate (os.listdir on a name that is not UTF-8)", "tokenizer TypeError, the run dead",
     "crosses as UTF-8 bytes, decoded with U+FFFD in its place",
     "python_tests/agents/test_tool_faults.py::test_a_lone_surrogate_reaches_the_trainer_as_valid_text"),
    ("an environment's step never returns", "the run hung, and SIGTERM did not end it",
     "the trajectory ends after rollout.multi_turn.env_timeout_s (multi_turn/env_timeouts)",
     "python_tests/agents/test_environment_faults.py::test_a_step_that_never_returns_ends_its_trajectory"),
    ("a tool starts processes; kill -9 of the trainer during a call", "12 of 12 alive after the run, 25 of 25 after "
     "close(); the workers outlived kill -9", "each worker's process group killed at the timeout, at close and when "
     "the trainer dies (its guardian)",
     "python_tests/agents/test_tool_faults.py::test_kill_9_of_the_trainer_during_a_call_takes_the_workers_and_their_children"),
    ("a tool returns a str subclass whose __reduce__ runs code", "it ran in the trainer (os._exit(0): exit 0 "
     "mid-step); an unpickling error escaped ToolExecutor.call", "results cross as bytes, never unpickled",
     "python_tests/agents/test_tool_faults.py::test_a_hostile_result_runs_no_code_in_the_trainer"),
    ("an environment returns None, a dict, messages as a string, a message without content or with int content",
     "library or jinja tracebacks naming no environment", "one line naming the environment, the method and what "
     "was wrong", "python_tests/agents/test_environment_faults.py::"
     "test_wrong_return_types_are_one_line_naming_the_environment_and_method"),
    ("a tool prints 8 MiB", "into the run's log, unbounded (400 MiB in one step)", "captured per call, cut to "
     "rollout.multi_turn.tool_output_max_bytes, counted in the metrics",
     "python_tests/agents/test_tool_faults.py::test_stdout_and_stderr_are_captured_bounded_and_counted"),
    ("ToolExecutor(timeout_s=nan or inf), ToolExecutor(workers=100000)", "accepted; every call then raised",
     "refused at construction naming the argument",
     "python_tests/agents/test_tool_faults.py::test_executor_limits_are_refused_at_construction"),
    ("resume from a checkpoint of another shape, model or optimizer", "one line of 1,268 characters holding DCP's "
     "flattened traceback", "one short line naming the cause",
     "python_tests/checkpoint/test_resume_refusals.py::test_resume_refusals_are_short_and_name_the_cause"),
    ("`verl-fast export` onto a full disk (an error that names no path)", "the path not named",
     "names the folder and its free space",
     "python_tests/checkpoint/test_resume_refusals.py::test_an_export_onto_a_full_disk_names_the_folder"),
    ("a tool-calling run with a timed-out tool, a forking tool and a step past its time limit", "never exited; "
     "processes left behind", "ends on its own; no worker, tool process or guardian left in /proc",
     "python_tests/agents/test_fault_run.py::"
     "test_a_run_with_a_timed_out_tool_a_forking_tool_and_a_hanging_environment_ends_and_leaves_nothing"),
]


def _hold_lock(folder: Path) -> subprocess.Popen:
    """Another process holding ``folder``'s run lock (as a running training would)."""
    folder.mkdir(parents=True)
    code = textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(folder / '.lock')!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, str(os.getpid()).encode())
        print("held", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cli_refusals_are_one_line_without_a_traceback(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if case.id == "flash_attention_missing" and importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    argv = case.argv(tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    had_checkpoints = checkpoints.exists()  # a case's own (export, resume_from)
    if case.id == "max_new_tokens_default_engine":  # the demo alias's folder, without converting the real one
        monkeypatch.setenv("VERL_FAST_CACHE", str(fake_demo_model(tmp_path)))
    holder = _hold_lock(tmp_path / "run") if case.id == "lock_held" else None
    try:
        line = refusal(argv, capsys)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    assert re.search(case.expect, line), line
    assert checkpoints.exists() == had_checkpoints  # refused before any step


PROGRAM_CASES = ["yaml_duplicate_section", "dataset_fifo", "chat_template_link", "export_missing", "convert_missing",
                 "max_shard_gb_nan"]


@pytest.mark.parametrize("case", [c for c in CASES if c.id in PROGRAM_CASES], ids=lambda c: c.id)
def test_the_installed_program_prints_one_line(case, tmp_path):
    """``python -m verl_fast`` (the installed command's path) on a case of each subcommand and kind:
    exit 2, the message the last line of stderr, and no traceback anywhere in it."""
    run = subprocess.run([sys.executable, "-m", "verl_fast", *case.argv(tmp_path)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert re.search(case.expect, run.stderr.strip().splitlines()[-1]), run.stderr


def test_a_bug_still_shows_its_traceback(monkeypatch):
    """An error no refusal raises (an IndexError in the code) is not turned into one line."""
    from verl_fast.cli import main as cli

    def broken(args):
        return [][1]

    monkeypatch.setattr(cli, "_info", broken)
    with pytest.raises(IndexError):
        cli.main(["info"])


def table() -> str:
    lines = ["| what the user does | before | what they see now | test |", "|---|---|---|---|"]
    for c in CASES:
        shown = c.expect.replace(r"\d+", "N").replace(".*", "…").replace("\\", "").replace("|", "\\|")
        lines.append(f"| {c.doing} | {c.before} | exit 2: `{shown}` | `test_cli_errors.py::"
                     f"test_cli_refusals_are_one_line_without_a_traceback[{c.id}]` |")
    for doing, before, after, test in OTHER_CASES:
        lines.append(f"| {doing} | {before} | {after} | `{test.split('/')[-1]}` |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- cases: begin (python python_tests/package/test_cli_errors.py) -->", "<!-- cases: end -->"


def test_the_docs_table_is_current():
    text = DOC.read_text()
    assert text.split(BEGIN)[1].split(END)[0].strip() == table().strip(), \
        "run `python python_tests/package/test_cli_errors.py` to regenerate docs/faults.md's table"
    root = DOC.parents[1]
    for *_, test in OTHER_CASES:  # each named test exists
        path, name = test.split("::")
        assert f"def {name}(" in (root / path).read_text(), test


if __name__ == "__main__":
    text = DOC.read_text()
    head, rest = text.split(BEGIN)
    DOC.write_text(head + BEGIN + "\n" + table() + END + rest.split(END)[1])
