"""RLDataProcessor: prompts from verl-format rows (parquet / JSONL / HF datasets / reasoning-gym),
chat-templated and tokenized for rollout; preference pairs for DPO.

A verl-format row: ``{"data_source": str, "prompt": [{"role": ..., "content": ...}, ...] or str,
"reward_model": {"ground_truth": ...}, "extra_info": {...}}``.
"""

from __future__ import annotations


from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from verl_fast import config
from verl_fast.data import readers
from verl_fast.data.images import ImageLimits, VisionInputs, VisionProcessor, encode_row, row_images, vision_messages
from verl_fast.files import hub
from verl_fast.records.prompts import PreferencePair, PromptBatch, PromptRow  # noqa: F401  (their import path)


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


def _is_chat(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) and "content" in m for m in x)


def _common_prefix(chosen: Any, rejected: Any) -> int:
    """Where chosen and rejected part (TRL's implicit prompt: whole messages, or characters, a space
    at the parting left to the responses)."""
    n = min(len(chosen), len(rejected))
    cut = next((i for i in range(n) if chosen[i] != rejected[i]), n)
    if isinstance(chosen, str) and cut > 0 and chosen[cut - 1] == " ":
        cut -= 1
    return cut


def preference_parts(row: Any) -> Optional[Tuple[Any, Any, Any]]:
    """(prompt, chosen, rejected) of a preference row in TRL's formats: explicit prompt
    (``prompt`` / ``chosen`` / ``rejected``) or implicit (``chosen`` / ``rejected`` as whole texts or
    conversations: their common start is the prompt), plain or conversational, with optional
    ``score_chosen`` / ``score_rejected``; or two scored answers (webgpt_comparisons: ``question``,
    ``answer_0`` / ``answer_1``, ``score_0`` / ``score_1``; also ``answer_1`` / ``answer_2``). None for a
    tie (left out); ValueError naming the keys for anything else."""
    keys = set(row) if isinstance(row, dict) else set()
    if {"chosen", "rejected"} <= keys:
        chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
        # TRL reads the prompt column unless the pairs are whole conversations (their first turn not the
        # assistant's) and the prompt is not a conversation too
        whole = _is_chat(chosen) and chosen[0].get("role", "assistant") != "assistant"
        if prompt is not None and (not whole or _is_chat(prompt)):
            return prompt, chosen, rejected
        if _is_chat(chosen) != _is_chat(rejected):
            raise ValueError("chosen and rejected must both be texts or both be chat messages")
        cut = _common_prefix(chosen, rejected)
        if cut == 0:
            raise ValueError("chosen and rejected share no prompt (implicit-prompt rows start with the same "
                             "prompt); give a prompt column")
        return chosen[:cut], chosen[cut:], rejected[cut:]
    for a, b in (("0", "1"), ("1", "2")):
        if {"question", f"answer_{a}", f"answer_{b}", f"score_{a}", f"score_{b}"} <= keys:
            if row[f"score_{a}"] == row[f"score_{b}"]:
                return None
            first = row[f"score_{a}"] > row[f"score_{b}"]
            question = row["question"]
            prompt = question["full_text"] if isinstance(question, dict) else question
            pair = (row[f"answer_{a}"], row[f"answer_{b}"])
            return (prompt,) + (pair if first else pair[::-1])
    raise ValueError("a preference row needs chosen/rejected (with or without prompt), or question/answer_0/"
                     f"answer_1/score_0/score_1, got keys {sorted(keys) if keys else type(row).__name__}")


def _text(content: Any) -> Optional[str]:
    """A response message's text: its string content, or its content list's text items joined (TRL's
    vision-language format); None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text" for c in content):
        return "".join(str(c.get("text", "")) for c in content)
    return None


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
                 overlong_prompts: str = "skip", image_limits: ImageLimits = ImageLimits()):
        """``tokenizer_name``: a tokenizer, a name, or a vision-language processor (rows with images
        then carry them: ``data/images.py``), resizing within ``image_limits``."""
        if isinstance(tokenizer_name, str):  # a folder, a hub name, or the demo model's name (as the CLI takes it)
            from transformers import AutoTokenizer

            from verl_fast.models.loading import resolve

            self.tokenizer = AutoTokenizer.from_pretrained(resolve(tokenizer_name))
        else:
            self.tokenizer = tokenizer_name
        self.vision = VisionProcessor.of(self.tokenizer)
        if self.vision is not None:
            self.vision.with_limits(image_limits)
        self.image_limits = image_limits
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
        if isinstance(source, (list, tuple)) and source and all(isinstance(s, (str, Path)) for s in source):
            return [row for one in source for row in self.load(one, **kwargs)]  # verl's list of files
        if isinstance(source, str) and source.startswith("reasoning_gym:"):
            return self.reasoning_gym_rows(source.split(":", 1)[1], **kwargs)
        if isinstance(source, (str, Path)):
            path = Path(source).expanduser()  # verl's configs write ~/data/...
            if not path.exists() and hub.is_repo_id(str(source)):
                return readers.checked(hub_rows(str(source), **kwargs), str(source))
            if not path.exists():
                raise FileNotFoundError(f"dataset {source} not found (parquet, jsonl, json, a datasets folder, "
                                        "a Hub dataset name, or reasoning_gym:<task>)")
            if path.is_dir():
                import datasets

                return readers.checked([dict(r) for r in datasets.load_from_disk(str(path))], str(path))
            if path.suffix == ".parquet":
                import pandas as pd

                readers.open_regular(path).close()  # not a FIFO or device
                return readers.checked([{k: _to_plain(v) for k, v in r.items()}
                                           for r in pd.read_parquet(path).to_dict("records")], str(path))
            if path.suffix == ".jsonl":
                return readers.read_jsonl(path)
            if path.suffix == ".json":
                return readers.read_json(path)
            if path.suffix in (".pt", ".pth"):
                readers.open_regular(path).close()
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
        import dataclasses
        import difflib

        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if task not in DATASETS:
            close = difflib.get_close_matches(task, list(DATASETS), n=3)
            raise ValueError(f"reasoning_gym has no task {task!r}" + (f"; did you mean {', '.join(close)}?" if close
                                                                      else f" ({len(DATASETS)} tasks)"))
        options = {f.name for f in dataclasses.fields(DATASETS[task][1])}
        unknown = sorted(set(task_kwargs) - options)
        if unknown:
            raise ValueError(f"dataset_kwargs.{unknown[0]}: reasoning_gym task {task} has no such option; its options: "
                             f"{', '.join(sorted(options))}")
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
        readers.check_truth(row)  # rows given in Python too: never a ground truth silently None
        ids, text, inputs = self._prompt(row["prompt"], row_images(row))
        fitted = self._fit(ids, text)
        if fitted is None:
            return None
        return PromptRow(prompt_ids=fitted[0], prompt_text=fitted[1], ground_truth=readers.ground_truth(row),
                         data_source=str(row.get("data_source", "")), extra_info=dict(row.get("extra_info") or {}),
                         columns=dict(row), vision=inputs)

    def _prompt(self, prompt: Any, raw_images: Optional[List[Any]]) -> Tuple[List[int], str, Optional[VisionInputs]]:
        """(token ids, templated text, images' inputs or None) of a row's prompt and raw images."""
        if raw_images is None:
            text = self.template(prompt)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if self.vision is not None and self.vision.image_token_id in ids:
                raise ValueError(f"the prompt holds {self.vision.image_token}, but the row has no images (an 'images' "
                                 "or 'image' column)")
            return ids, text, None
        if self.vision is None:
            raise ValueError("the row has images, but the tokenizer is not a vision-language processor (give "
                             "the model's processor, e.g. AutoProcessor.from_pretrained)")
        ids, text, inputs = encode_row(self.vision, self.messages(prompt), raw_images, self.image_limits)
        if len(ids) > self.max_prompt_length and self.overlong_prompts == "truncate_left":
            raise ValueError(f"a prompt with images has {len(ids)} tokens, more than max_prompt_length="
                             f"{self.max_prompt_length}: truncate_left would cut its image tokens")
        return ids, text, inputs

    def encode_all(self, rows: Iterable[Dict[str, Any]]) -> List[PromptRow]:
        """Every row's prompt; overlong ones skipped are counted in ``skipped_overlong``; an error
        names the row's file and line (``readers.Rows``) or its index."""
        encoded = []
        for i, r in enumerate(rows):
            try:
                encoded.append(self.encode(r))
            except ValueError as e:
                raise ValueError(f"{readers.where(rows, i)}: {e}") from None
        kept = [p for p in encoded if p is not None]
        self.skipped_overlong = len(encoded) - len(kept)
        if encoded and not kept:
            raise ValueError(f"all {len(encoded)} prompts are longer than max_prompt_length="
                             f"{self.max_prompt_length} tokens and were skipped (overlong_prompts='skip'); "
                             "raise the limit or use overlong_prompts='truncate_left'")
        return kept

    # ------------------------------------------------------------------ DPO

    def build_dpo_dataset(self, dataset: Any) -> List[PreferencePair]:
        """Preference pairs from rows in TRL's formats (``preference_parts``: explicit or implicit
        prompt, plain or conversational; webgpt_comparisons' scored answers, ties dropped). Prompts
        get the chat template; responses may be strings or chat messages (see ``response_text``) and
        end in EOS."""
        rows = self.load(dataset) if not isinstance(dataset, list) else dataset
        pairs = []
        for i, row in enumerate(rows):
            try:
                parts = preference_parts(row)
            except ValueError as e:
                raise ValueError(f"preference row {i}: {e}") from None
            if parts is None:
                continue
            prompt, chosen, rejected = parts
            raw_images = row_images(row)
            try:
                ids, text, inputs = self._prompt(prompt, raw_images)
                if raw_images is not None:  # the responses follow the prompt with its image items
                    prompt = vision_messages(self.messages(prompt), len(raw_images))
                chosen = self.response_text(prompt, chosen, "chosen")
                rejected = self.response_text(prompt, rejected, "rejected")
            except ValueError as e:
                raise ValueError(f"preference row {i}: {e}") from None
            fitted = self._fit(ids, text)
            if fitted is None:
                self.skipped_overlong += 1
                continue
            prompt_ids, text = fitted
            pairs.append(PreferencePair(prompt=text, chosen=chosen, rejected=rejected, prompt_ids=prompt_ids,
                                        chosen_ids=self._response_ids(chosen),
                                        rejected_ids=self._response_ids(rejected), vision=inputs))
        return pairs

    def response_text(self, prompt: Any, response: Any, key: str) -> str:
        """A response as text: a string as it is; chat messages (TRL's conversational format:
        ``[{"role": "assistant", "content": ...}]``) through the chat template, as the text the
        template puts after the prompt's generation prompt (with its end-of-turn tokens)."""
        if isinstance(response, str):
            return response
        if not (isinstance(response, list) and response
                and all(isinstance(m, dict) and _text(m.get("content")) is not None for m in response)):
            raise ValueError(f"{key} must be a string or a non-empty list of chat messages "
                             f"({{'role': ..., 'content': ...}}), got {response!r}")
        turns = [{"role": m.get("role", "assistant"), "content": _text(m["content"])} for m in response]
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
