"""RLDataProcessor: prompts from verl-format rows, chat-templated and tokenized for rollout, within
``max_prompt_length`` (``overlong_prompts``); preference pairs for DPO.

A verl-format row: ``{"data_source": str, "prompt": [{"role": ..., "content": ...}, ...] or str,
"reward_model": {"ground_truth": ...}, "extra_info": {...}}``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from verl_fast import config
from verl_fast.data import readers
from verl_fast.data.images import ImageLimits, VisionInputs, VisionProcessor, encode_row, row_images, vision_messages
from verl_fast.data.preference import preference_parts
from verl_fast.data.sources import load_rows, reasoning_gym_rows
from verl_fast.records.prompts import PreferencePair, PromptRow


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

    load = staticmethod(load_rows)
    reasoning_gym_rows = staticmethod(reasoning_gym_rows)

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
