"""RLDataProcessor: prompts from verl-format rows (parquet / JSONL / HF datasets / reasoning-gym),
chat-templated and tokenized for rollout; preference pairs for DPO.

A verl-format row: ``{"data_source": str, "prompt": [{"role": ..., "content": ...}, ...] or str,
"reward_model": {"ground_truth": ...}, "extra_info": {...}}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from verl_fast import config, data_files, hub


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


def hub_rows(name: str, split: str = "train", **kwargs: Any) -> List[Dict[str, Any]]:
    """The rows of split ``split`` of the Hub dataset ``name`` through ``datasets.load_dataset``
    (its own cache first; ``kwargs``: ``name`` of the configuration, ``data_dir``, ...). When the Hub
    is not reachable (or ``HF_HUB_OFFLINE`` is set), the dataset's files in the HF hub cache
    (``datasets--org--name/snapshots/<rev>/``, as an earlier download left them) are loaded by
    ``datasets`` from that folder; found nowhere: ``hub.NameNotFound``."""
    import datasets

    try:
        data = datasets.load_dataset(name, split=split, **kwargs)
    except ConnectionError as unreachable:  # offline or no network: the hub cache's copy, if any
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(name, repo_type="dataset", local_files_only=True)
        except FileNotFoundError:  # LocalEntryNotFoundError: no snapshot of it in the cache
            raise hub.not_found("trainer.dataset", name, unreachable) from None
        data = datasets.load_dataset(folder, split=split, **kwargs)
    except datasets.exceptions.DatasetNotFoundError as e:
        raise hub.not_found("trainer.dataset", name, e) from None
    return [{k: _to_plain(v) for k, v in r.items()} for r in data]


OVERLONG_PROMPTS = ("skip", "error", "truncate_left")
config.OVERLONG_PROMPTS.register(*OVERLONG_PROMPTS)


class RLDataProcessor:
    """Turns datasets into tokenized prompts (and preference pairs) for the trainer.

    A prompt longer than ``max_prompt_length`` tokens (after the chat template) is, by
    ``overlong_prompts``: ``"skip"`` left out of the data (counted in ``skipped_overlong``),
    ``"error"`` a ValueError, or ``"truncate_left"`` cut to its last tokens, and then its text is
    the decoded kept tokens, so the reward sees exactly the prompt the model saw.
    """

    def __init__(self, tokenizer_name: Union[str, Any], max_prompt_length: int = 512,
                 max_response_length: int = 512, system_prompt: Optional[str] = None,
                 overlong_prompts: str = "skip"):
        if isinstance(tokenizer_name, str):  # a folder, a hub name, or the demo model's name (as the CLI takes it)
            from transformers import AutoTokenizer

            from verl_fast.models.loading import resolve

            self.tokenizer = AutoTokenizer.from_pretrained(resolve(tokenizer_name))
        else:
            self.tokenizer = tokenizer_name
        if overlong_prompts not in OVERLONG_PROMPTS:
            raise ValueError(f"overlong_prompts must be one of {list(OVERLONG_PROMPTS)}, got {overlong_prompts!r}")
        if max_prompt_length < 1 or max_response_length < 1:
            raise ValueError("max_prompt_length and max_response_length must be >= 1")
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.system_prompt = system_prompt
        self.overlong_prompts = overlong_prompts
        self.skipped_overlong = 0  # prompts left out by encode_all (overlong_prompts="skip")

    # ------------------------------------------------------------------ loading

    def load(self, source: Any, **kwargs: Any) -> List[Dict[str, Any]]:
        """verl-format rows from a parquet / JSONL / JSON file, a folder saved by ``datasets``, a Hub
        dataset name (``org/name``; kwargs go to ``datasets.load_dataset``: ``name``, ``split``, ...), a
        ``datasets.Dataset``, ``"reasoning_gym:<task>"`` (kwargs go to ``create_dataset``), or a list."""
        if isinstance(source, str) and source.startswith("reasoning_gym:"):
            return self.reasoning_gym_rows(source.split(":", 1)[1], **kwargs)
        if isinstance(source, (str, Path)):
            path = Path(source)
            if not path.exists() and hub.is_repo_id(str(source)):
                return data_files.checked(hub_rows(str(source), **kwargs), str(source))
            if not path.exists():
                raise FileNotFoundError(f"dataset {source} not found (parquet, jsonl, json, a datasets folder, "
                                        "a Hub dataset name, or reasoning_gym:<task>)")
            if path.is_dir():
                import datasets

                return data_files.checked([dict(r) for r in datasets.load_from_disk(str(path))], str(path))
            if path.suffix == ".parquet":
                import pandas as pd

                data_files.open_regular(path).close()  # not a FIFO or device
                return data_files.checked([{k: _to_plain(v) for k, v in r.items()}
                                           for r in pd.read_parquet(path).to_dict("records")], str(path))
            if path.suffix == ".jsonl":
                return data_files.read_jsonl(path)
            if path.suffix == ".json":
                return data_files.read_json(path)
            if path.suffix in (".pt", ".pth"):
                data_files.open_regular(path).close()
                from verl_fast.files import safe_load

                data = safe_load.load(path, [PromptRow, PreferencePair], what="a dataset")  # rows are plain data
                kinds = (dict, PromptRow, PreferencePair)  # what encode_all / build_dpo_dataset return
                if not isinstance(data, (list, tuple)) or not all(isinstance(r, kinds) for r in data):
                    raise ValueError(f"{path}: expected a list of rows (dicts, PromptRow or PreferencePair), "
                                     f"got {type(data).__name__}")
                return [dict(r) if isinstance(r, dict) else r for r in data]
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

    def _fit(self, ids: List[int], text: str) -> Optional[Tuple[List[int], str]]:
        """(ids, text) of a prompt within max_prompt_length, or None to skip it."""
        limit = self.max_prompt_length
        if len(ids) <= limit:
            return ids, text
        if self.overlong_prompts == "error":
            raise ValueError(f"a prompt has {len(ids)} tokens, more than max_prompt_length={limit} "
                             f"(overlong_prompts='error'; or 'skip' / 'truncate_left'): {text[:80]!r}...")
        if self.overlong_prompts == "skip":
            return None
        kept = ids[-limit:]
        return kept, self.tokenizer.decode(kept)

    def encode(self, row: Dict[str, Any]) -> Optional[PromptRow]:
        """The row's prompt, or None when it is overlong and overlong_prompts is 'skip'."""
        if not isinstance(row, dict) or "prompt" not in row:
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"a row needs a 'prompt' field (verl format), got {got}")
        data_files.check_truth(row)  # rows given in Python too: never a ground truth silently None
        text = self.template(row["prompt"])
        fitted = self._fit(self.tokenizer(text, add_special_tokens=False)["input_ids"], text)
        if fitted is None:
            return None
        return PromptRow(prompt_ids=fitted[0], prompt_text=fitted[1], ground_truth=data_files.ground_truth(row),
                         data_source=str(row.get("data_source", "")), extra_info=dict(row.get("extra_info") or {}),
                         columns=dict(row))

    def encode_all(self, rows: Iterable[Dict[str, Any]]) -> List[PromptRow]:
        """Every row's prompt; overlong ones skipped are counted in ``skipped_overlong``; an error
        names the row's file and line (``data_files.Rows``) or its index."""
        encoded = []
        for i, r in enumerate(rows):
            try:
                encoded.append(self.encode(r))
            except ValueError as e:
                raise ValueError(f"{data_files.where(rows, i)}: {e}") from None
        kept = [p for p in encoded if p is not None]
        self.skipped_overlong = len(encoded) - len(kept)
        if encoded and not kept:
            raise ValueError(f"all {len(encoded)} prompts are longer than max_prompt_length="
                             f"{self.max_prompt_length} tokens and were skipped (overlong_prompts='skip'); "
                             "raise the limit or use overlong_prompts='truncate_left'")
        return kept

    # ------------------------------------------------------------------ DPO

    def build_dpo_dataset(self, dataset: Any) -> List[PreferencePair]:
        """Preference pairs from rows with ``prompt``/``chosen``/``rejected`` or with two scored
        answers (``question``, ``answer_1``, ``answer_2``, ``score_1``, ``score_2``, as in
        webgpt_comparisons; ties are dropped). Prompts get the chat template; responses may be strings
        or chat messages (TRL's conversational format, see ``response_text``) and end in EOS."""
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
            chosen = self.response_text(prompt, chosen, "chosen")
            rejected = self.response_text(prompt, rejected, "rejected")
            fitted = self._fit(self.tokenizer(text, add_special_tokens=False)["input_ids"], text)
            if fitted is None:
                self.skipped_overlong += 1
                continue
            prompt_ids, text = fitted
            pairs.append(PreferencePair(prompt=text, chosen=chosen, rejected=rejected, prompt_ids=prompt_ids,
                                        chosen_ids=self._response_ids(chosen),
                                        rejected_ids=self._response_ids(rejected)))
        return pairs

    def response_text(self, prompt: Any, response: Any, key: str) -> str:
        """A response as text: a string as it is; chat messages (TRL's conversational format:
        ``[{"role": "assistant", "content": ...}]``) through the chat template, as the text the
        template puts after the prompt's generation prompt (with its end-of-turn tokens)."""
        if isinstance(response, str):
            return response
        if not (isinstance(response, list) and response
                and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in response)):
            raise ValueError(f"{key} must be a string or a non-empty list of chat messages "
                             f"({{'role': ..., 'content': ...}}), got {response!r}")
        turns = [{"role": m.get("role", "assistant"), "content": m["content"]} for m in response]
        if not getattr(self.tokenizer, "chat_template", None):
            return "\n".join(m["content"] for m in turns)
        head = self.template(prompt)
        whole = self.tokenizer.apply_chat_template(self.messages(prompt) + turns, tokenize=False)
        if not whole.startswith(head):
            raise ValueError(f"{key}: the chat template does not render the prompt with its generation prompt as "
                             "a prefix of the whole conversation, so the response's tokens cannot be separated; "
                             "give the responses as strings")
        return whole[len(head):]

    def _response_ids(self, text: str) -> List[int]:
        """A response's token ids, ending in EOS (appended unless the text holds it already, as a chat
        template's end of turn may), cut to max_response_length."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos not in ids:
            ids = ids + [eos]
        return ids[: self.max_response_length]
