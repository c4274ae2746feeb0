"""``reward_fn.type: judge``: a generative model scores each response (LLM-as-judge). A prompt template
is filled with the row's prompt, the response and the ground truth, the judge writes a verdict, and a
parser reads the score from it: ``score`` (``Score: 7`` read as 7 / ``max_score``), ``verdict`` (the
last of the ``verdicts`` words found, e.g. yes -> 1, no -> 0) or ``module:function`` (text -> float or
None). A verdict the parser cannot read scores ``failure_score`` and is counted.

The judge is a Hugging Face causal LM (``model_name``: greedy, batched, left-padded, on the GPU when
there is one) or an OpenAI-compatible server (``url``: ``/chat/completions`` requests, ``batch_size``
of them in flight)."""

from __future__ import annotations

import json
import os
import re
import string
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from verl_fast import config
from verl_fast.config import option, read_section
from verl_fast.rewards.interface import RewardFunction, RewardInput, load_callable

DEFAULT_TEMPLATE = ("You are grading an answer.\n\nQuestion:\n{prompt}\n\nReference answer:\n{ground_truth}\n\n"
                    "Answer to grade:\n{response}\n\nReply with one line 'Score: N', N from 0 (wrong) to 10 "
                    "(right and complete).")
PARSERS = ("score", "verdict")
# the placeholders every row fills; a template may also name any dataset column
FIELDS = ("prompt", "response", "ground_truth", "data_source")


@dataclass
class JudgeConfig:
    model_name: Optional[str] = option(None, doc="the judge as a Hugging Face causal LM (local folder or Hub name)")
    url: Optional[str] = option(None, doc="the judge as an OpenAI-compatible server's base URL (http://host:port/v1)")
    model: str = option("judge", doc="url: the model name sent with each request")
    api_key_env: Optional[str] = option(None, doc="url: the environment variable holding the API key (Bearer)")
    prompt_template: str = option(DEFAULT_TEMPLATE, doc="the judge's prompt: {prompt}, {response}, {ground_truth}, "
                              "{data_source} and any dataset column by name")
    parser: str = option("score", doc="score ('Score: N' / max_score), verdict (the last of verdicts' words), or "
                     "module:function (the judge's text -> float or None)")
    max_score: float = option(10.0, above=0.0, doc="parser score: the top of the judge's scale (read scores are divided "
                          "by it; one outside [0, max_score] is a parse failure)")
    verdicts: Dict[str, float] = option(lambda: {"yes": 1.0, "no": 0.0}, doc="parser verdict: word -> score")
    failure_score: float = option(0.0, doc="the score of a verdict the parser cannot read (counted as "
                              "reward/<name>/parse_failures)")
    max_new_tokens: int = option(64, min=1, doc="tokens the judge may write per verdict")
    batch_size: int = option(16, min=1, doc="verdicts generated together (model_name) or requests in flight (url)")
    request_timeout_s: float = option(60.0, above=0.0, doc="url: seconds one request may take")


def parse(raw: Optional[Dict[str, Any]], key: str = "reward_fn") -> JudgeConfig:
    cfg = read_section(JudgeConfig, raw or {}, f"{key}.judge")
    if (cfg.model_name is None) == (cfg.url is None):
        raise ValueError(f"{key}.judge needs exactly one of model_name (a causal LM) and url (an OpenAI-compatible "
                         "server)")
    if cfg.parser not in PARSERS and ":" not in cfg.parser:
        raise ValueError(f"{key}.judge.parser must be one of {list(PARSERS)} or module:function, got {cfg.parser!r}")
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(cfg.prompt_template) if name is not None]
    except ValueError as e:
        raise ValueError(f"{key}.judge.prompt_template: {e}") from None
    if any(not n.isidentifier() for n in names):
        raise ValueError(f"{key}.judge.prompt_template: placeholders must be plain names ({{response}}), got "
                         f"{[n for n in names if not n.isidentifier()]}")
    bad = [w for w, v in cfg.verdicts.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if not cfg.verdicts or bad:
        raise ValueError(f"{key}.judge.verdicts must map words to numbers, got {cfg.verdicts!r}")
    return cfg


_SCORE = re.compile(r"score\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)", re.I)


def score_parser(max_score: float) -> Callable[[str], Optional[float]]:
    """'Score: N' (the last one; else a text that is only a number) -> N / max_score, None outside [0, max]."""
    def read(text: str) -> Optional[float]:
        found = _SCORE.findall(text)
        value = found[-1] if found else text.strip()
        try:
            n = float(value)
        except ValueError:
            return None
        return n / max_score if 0 <= n <= max_score else None
    return read


def verdict_parser(verdicts: Dict[str, float]) -> Callable[[str], Optional[float]]:
    """The score of the last verdict word in the text (whole words, any case); None when there is none."""
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in sorted(verdicts, key=len, reverse=True)) + r")\b",
                         re.I)
    lower = {w.lower(): v for w, v in verdicts.items()}

    def read(text: str) -> Optional[float]:
        found = pattern.findall(text)
        return float(lower[found[-1].lower()]) if found else None
    return read


class HFJudge:
    """Greedy verdicts from a causal LM, ``batch_size`` prompts per ``generate`` (left-padded); the prompt
    goes through the tokenizer's chat template as a user turn when it has one."""

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int = 64, batch_size: int = 16):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "HFJudge":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from verl_fast.models.loading import pretrained

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = pretrained(AutoModelForCausalLM, path, "reward_fn.judge.model_name", dtype=dtype).to(device)
        return cls(model, pretrained(AutoTokenizer, path, "reward_fn.judge.model_name"), **kwargs)

    def _text(self, prompt: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
        return prompt

    def complete(self, prompts: Sequence[str]) -> List[str]:
        import torch

        out: List[str] = []
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "left"
        try:
            for i in range(0, len(prompts), self.batch_size):
                enc = self.tokenizer([self._text(p) for p in prompts[i:i + self.batch_size]], return_tensors="pt",
                                     padding=True, add_special_tokens=False).to(self.model.device)
                with torch.no_grad():
                    ids = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                              pad_token_id=self.tokenizer.pad_token_id)
                out.extend(self.tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True))
        finally:
            self.tokenizer.padding_side = side
        return out


class URLJudge:
    """Verdicts from an OpenAI-compatible server: one ``/chat/completions`` request per prompt (temperature
    0), ``workers`` in flight."""

    def __init__(self, url: str, model: str, api_key: Optional[str] = None, max_new_tokens: int = 64,
                 workers: int = 16, timeout_s: float = 60.0):
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.max_new_tokens = model, api_key, max_new_tokens
        self.workers, self.timeout_s = workers, timeout_s

    def _one(self, prompt: str) -> str:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}],
                           "temperature": 0.0, "max_tokens": self.max_new_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.endpoint, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            reply = json.loads(response.read())
        try:
            return reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"judge at {self.endpoint}: a reply without choices[0].message.content: "
                             f"{str(reply)[:200]}") from None

    def complete(self, prompts: Sequence[str]) -> List[str]:
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self._one, prompts))


def _question(s: RewardInput) -> str:
    """The row's prompt as written: the last user turn of a chat prompt, else the prompt text."""
    raw = s.columns.get("prompt")
    if isinstance(raw, list):
        users = [m.get("content", "") for m in raw if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return str(users[-1])
    return raw if isinstance(raw, str) else s.prompt


def _truth(value: Any) -> Any:
    """The ground truth as the judge reads it: a record's ``answer`` (a reasoning-gym entry), else itself."""
    if value is None:
        return ""
    return value["answer"] if isinstance(value, dict) and "answer" in value else value


class JudgeReward(RewardFunction):
    """Scores responses with ``backend.complete(prompts) -> texts`` and the configured parser.
    ``last_extras``: per sample ``parse_failures`` (0 / 1) and ``seconds`` (the batch's)."""

    name = "judge"

    def __init__(self, backend: Any, settings: JudgeConfig):
        self.backend, self.settings = backend, settings
        if settings.parser == "score":
            self.read = score_parser(settings.max_score)
        elif settings.parser == "verdict":
            self.read = verdict_parser(settings.verdicts)
        else:
            self.read = load_callable(settings.parser)
        self.last_extras: Dict[str, List[float]] = {}
        self.last_texts: List[str] = []

    @classmethod
    def from_config(cls, settings: JudgeConfig) -> "JudgeReward":
        if settings.url is not None:
            key = os.environ.get(settings.api_key_env) if settings.api_key_env else None
            backend: Any = URLJudge(settings.url, settings.model, key, settings.max_new_tokens, settings.batch_size,
                                    settings.request_timeout_s)
        else:
            backend = HFJudge.from_pretrained(settings.model_name, max_new_tokens=settings.max_new_tokens,
                                              batch_size=settings.batch_size)
        return cls(backend, settings)

    def _prompt(self, s: RewardInput, index: int) -> str:
        values = {k: v for k, v in s.columns.items()}
        values.update(prompt=_question(s), response=s.response, ground_truth=_truth(s.ground_truth),
                      data_source=s.data_source)
        try:
            return self.settings.prompt_template.format_map(values)
        except KeyError as e:
            raise ValueError(f"reward_fn.judge.prompt_template names {{{e.args[0]}}}, which sample {index} lacks "
                             f"(it has {sorted(values)})") from None

    def __call__(self, samples: Sequence[RewardInput]) -> List[float]:
        prompts = [self._prompt(s, i) for i, s in enumerate(samples)]
        start = time.monotonic()
        texts = self.backend.complete(prompts)
        seconds = time.monotonic() - start
        scores, failures = [], []
        for text in texts:
            value = self.read(text)
            failed = value is None
            failures.append(float(failed))
            scores.append(self.settings.failure_score if failed else float(value))
        self.last_texts = list(texts)
        self.last_extras = {"parse_failures": failures, "seconds": [seconds] * len(samples)}
        return scores


def _check(cfg: config.Config) -> None:
    for key, r in config.keyed_reward_functions(cfg.reward_fn):
        if r.judge and r.type != "judge":
            raise ValueError(f"{key}.judge applies to {key}.type=judge only, got type {r.type}")
        if r.type == "judge":
            if not r.judge:
                raise ValueError(f"{key}.type=judge needs {key}.judge with model_name or url")
            parse(r.judge, key)


config.register_check(_check)
