"""RLDataProcessor: prompts from verl-format rows (parquet / JSONL / HF datasets / reasoning-gym),
chat-templated and tokenized for rollout; preference pairs for DPO.

A verl-format row: ``{"data_source": str, "prompt": [{"role": ..., "content": ...}, ...] or str,
"reward_model": {"ground_truth": ...}, "extra_info": {...}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union


@dataclass
class PromptRow:
    """One prompt ready for rollout."""

    prompt_ids: List[int]
    prompt_text: str  # after the chat template
    ground_truth: Any = None
    data_source: str = ""
    extra_info: Dict[str, Any] = field(default_factory=dict)
    columns: Dict[str, Any] = field(default_factory=dict)  # every field of the source row, as given


class PromptBatch(list):
    """The prompts of one rollout call, as ``RolloutOperator.get_generation_kwargs`` sees them: a list
    of PromptRow (``batch[0]``, ``for row in batch``) that also answers column access:
    ``batch["task_type"]`` is that field of every row, in order (any column of the source rows, or a
    PromptRow attribute such as ``data_source``)."""

    def __getitem__(self, key):
        if not isinstance(key, str):
            return super().__getitem__(key)
        values = []
        for i, row in enumerate(self):
            if key in row.columns:
                values.append(row.columns[key])
            elif key in PromptRow.__dataclass_fields__ and key != "columns":
                values.append(getattr(row, key))
            else:
                raise KeyError(f"batch[{key!r}]: row {i} has no column {key!r}; its columns: {sorted(row.columns)}")
        return values


@dataclass
class PreferencePair:
    """One DPO example: token ids of the prompt and of both responses (EOS appended)."""

    prompt: str
    chosen: str
    rejected: str
    prompt_ids: List[int]
    chosen_ids: List[int]
    rejected_ids: List[int]


def _to_plain(x: Any) -> Any:
    """numpy / pandas / pyarrow containers from parquet back to plain Python."""
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        x = x.tolist()
    if isinstance(x, dict):
        return {k: _to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_plain(v) for v in x]
    return x


def _load_torch_rows(path: Path) -> List[Any]:
    """A ``torch.save``d list of rows (dicts), PromptRow or PreferencePair (what ``encode_all`` /
    ``build_dpo_dataset`` return), read with ``weights_only=True``: plain containers and those two
    classes unpickle, anything else is refused (a dataset file is data, never code)."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals([PromptRow, PreferencePair]):
            data = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"dataset {path}: refused to unpickle it ({str(e).splitlines()[-1][:200]}); a .pt "
                         "dataset may hold only a list of dicts, PromptRow or PreferencePair") from None
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"dataset {path} must hold a list of rows, got {type(data).__name__}")
    return [r if isinstance(r, (PromptRow, PreferencePair)) else dict(r) for r in data]


class RLDataProcessor:
    """Turns datasets into tokenized prompts (and preference pairs) for the trainer."""

    def __init__(self, tokenizer_name: Union[str, Any], max_prompt_length: int = 512,
                 max_response_length: int = 512, system_prompt: Optional[str] = None,
                 truncation: str = "left"):
        if isinstance(tokenizer_name, str):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
        else:
            self.tokenizer = tokenizer_name
        if truncation not in ("left", "right", "error"):
            raise ValueError(f"truncation must be left, right or error, got {truncation!r}")
        if max_prompt_length < 1 or max_response_length < 1:
            raise ValueError("max_prompt_length and max_response_length must be >= 1")
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.system_prompt = system_prompt
        self.truncation = truncation

    # ------------------------------------------------------------------ loading

    def load(self, source: Any, **kwargs: Any) -> List[Dict[str, Any]]:
        """verl-format rows from a parquet / JSONL / JSON file, a folder saved by ``datasets``, a
        ``datasets.Dataset``, ``"reasoning_gym:<task>"`` (kwargs go to ``create_dataset``), or a list."""
        if isinstance(source, str) and source.startswith("reasoning_gym:"):
            return self.reasoning_gym_rows(source.split(":", 1)[1], **kwargs)
        if isinstance(source, (str, Path)):
            path = Path(source)
            if not path.exists():
                raise FileNotFoundError(f"dataset {source} not found (parquet, jsonl, json, a datasets folder, "
                                        "or reasoning_gym:<task>)")
            if path.is_dir():
                import datasets

                return [dict(r) for r in datasets.load_from_disk(str(path))]
            if path.suffix == ".parquet":
                import pandas as pd

                return [{k: _to_plain(v) for k, v in r.items()} for r in pd.read_parquet(path).to_dict("records")]
            if path.suffix == ".jsonl":
                return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if path.suffix == ".json":
                data = json.loads(path.read_text())
                return data if isinstance(data, list) else [data]
            if path.suffix in (".pt", ".pth"):
                return _load_torch_rows(path)
            raise ValueError(f"unsupported dataset file {path.name}: use .parquet, .jsonl, .json or .pt")
        if hasattr(source, "column_names") and hasattr(source, "__iter__"):  # datasets.Dataset
            return [dict(r) for r in source]
        if isinstance(source, Sequence):
            return [dict(r) for r in source]
        raise TypeError(f"unsupported dataset source {type(source).__name__}")

    def reasoning_gym_rows(self, task: str, size: int = 1000, seed: int = 42, **task_kwargs: Any) -> List[Dict[str, Any]]:
        import reasoning_gym

        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_kwargs)
        return [{"data_source": f"reasoning_gym/{task}", "prompt": [{"role": "user", "content": e["question"]}],
                 "reward_model": {"ground_truth": _to_plain(e)}, "extra_info": {"index": i}}
                for i, e in enumerate(dataset)]

    # ------------------------------------------------------------------ prompts

    def messages(self, prompt: Any) -> List[Dict[str, str]]:
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
            messages = [{"role": m.get("role", "user"), "content": m["content"]} for m in prompt]
        else:
            raise ValueError(f"a prompt must be a string or a list of chat messages, got {prompt!r}")
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return messages

    def template(self, prompt: Any) -> str:
        messages = self.messages(prompt)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n".join(m["content"] for m in messages) + "\n"

    def _truncate(self, ids: List[int], limit: int, what: str) -> List[int]:
        if len(ids) <= limit:
            return ids
        if self.truncation == "error":
            raise ValueError(f"{what} has {len(ids)} tokens, more than {limit}")
        return ids[-limit:] if self.truncation == "left" else ids[:limit]

    def encode(self, row: Dict[str, Any]) -> PromptRow:
        if "prompt" not in row:
            raise ValueError(f"a row needs a 'prompt' field (verl format), got keys {sorted(row)}")
        text = self.template(row["prompt"])
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        reward = row.get("reward_model") or {}
        truth = reward.get("ground_truth") if isinstance(reward, dict) else None
        if truth is None:
            truth = row.get("ground_truth", row.get("answer"))
        return PromptRow(prompt_ids=self._truncate(ids, self.max_prompt_length, "a prompt"), prompt_text=text,
                         ground_truth=truth, data_source=str(row.get("data_source", "")),
                         extra_info=dict(row.get("extra_info") or {}), columns=dict(row))

    def encode_all(self, rows: Iterable[Dict[str, Any]]) -> List[PromptRow]:
        return [self.encode(r) for r in rows]

    # ------------------------------------------------------------------ DPO

    def build_dpo_dataset(self, dataset: Any) -> List[PreferencePair]:
        """Preference pairs from rows with ``prompt``/``chosen``/``rejected`` or with two scored
        answers (``question``, ``answer_1``, ``answer_2``, ``score_1``, ``score_2``, as in
        webgpt_comparisons; ties are dropped). Prompts get the chat template; responses end in EOS."""
        rows = self.load(dataset) if not isinstance(dataset, list) else dataset
        pairs = []
        for row in rows:
            if {"prompt", "chosen", "rejected"} <= set(row):
                prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
            elif {"question", "answer_1", "answer_2", "score_1", "score_2"} <= set(row):
                if row["score_1"] == row["score_2"]:
                    continue
                first = row["score_1"] > row["score_2"]
                prompt = row["question"]["full_text"] if isinstance(row["question"], dict) else row["question"]
                chosen, rejected = (row["answer_1"], row["answer_2"]) if first else (row["answer_2"], row["answer_1"])
            else:
                raise ValueError("a preference row needs prompt/chosen/rejected or question/answer_1/answer_2/"
                                 f"score_1/score_2, got keys {sorted(row)}")
            text = self.template(prompt)
            eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []

            def response_ids(r: str) -> List[int]:
                ids = self.tokenizer(r, add_special_tokens=False)["input_ids"] + eos
                return ids[: self.max_response_length]

            prompt_ids = self._truncate(self.tokenizer(text, add_special_tokens=False)["input_ids"],
                                        self.max_prompt_length, "a prompt")
            pairs.append(PreferencePair(prompt=text, chosen=chosen, rejected=rejected, prompt_ids=prompt_ids,
                                        chosen_ids=response_ids(chosen), rejected_ids=response_ids(rejected)))
        return pairs
