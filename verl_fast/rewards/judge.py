"""``reward_fn.type: judge``: a generative model scores each response (LLM-as-judge). A prompt template
is filled with the row's prompt, the response and the ground truth, the judge writes a verdict, and a
parser reads the score from it: ``score`` (``Score: 7`` read as 7 / ``max_score``), ``verdict`` (the
last of the ``verdicts`` words found, e.g. yes -> 1, no -> 0) or ``module:function`` (text -> float or
None). A verdict the parser cannot read scores ``failure_score`` and is counted.

The judge (``engine``) is the run's own rollout engine (``rollout``: the actor's current weights, on the
engine that sampled the responses, the batch's judge prompts in one greedy ``generate`` call after the
rollout and before the engine sleeps; the default where neither ``model_name`` nor ``url`` is given), a
Hugging Face causal LM loaded once (``model``, from ``model_name``: greedy, batched, left-padded, on the
GPU when there is one) or an OpenAI-compatible server (``url``: ``/chat/completions`` requests,
``batch_size`` of them in flight)."""

from __future__ import annotations

import json
import os
import re
import string
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence

from verl_fast import config
from verl_fast.config import option, read_section
from verl_fast.rewards.interface import RewardFunction, RewardInput, load_callable

DEFAULT_TEMPLATE = ("You are grading an answer.\n\nQuestion:\n{prompt}\n\nReference answer:\n{ground_truth}\n\n"
                    "Answer to grade:\n{response}\n\nReply with one line 'Score: N', N from 0 (wrong) to 10 "
                    "(right and complete).")
PARSERS = ("score", "verdict")
ENGINES = ("auto", "rollout", "model", "url")
# the placeholders every row fills; a template may also name any dataset column
FIELDS = ("prompt", "response", "ground_truth", "data_source")


@dataclass
class JudgeConfig:
    engine: str = option("auto", choices=ENGINES, doc="who writes the verdicts: rollout (the run's own rollout engine, "
                         "the actor's weights), model (model_name loaded once), url (an OpenAI-compatible server); "
                         "auto: url or model where given, else rollout")
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
    given = [k for k in ("model_name", "url") if getattr(cfg, k) is not None]
    if len(given) > 1:
        raise ValueError(f"{key}.judge takes one of model_name (a causal LM) and url (an OpenAI-compatible server), "
                         "got both")
    engine = cfg.engine if cfg.engine != "auto" else {"model_name": "model", "url": "url"}.get(
        given[0] if given else "", "rollout")
    needs = {"model": "model_name", "url": "url"}.get(engine)
    if given != ([needs] if needs else []):
        raise ValueError(f"{key}.judge.engine={engine} " + (f"needs {key}.judge.{needs}" if needs else
                         f"judges on the run's rollout engine: remove {key}.judge.{given[0]}"))
    cfg = replace(cfg, engine=engine)
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


def judge_text(tokenizer: Any, prompt: str) -> str:
    """The judge's prompt as a user turn of the tokenizer's chat template, where it has one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


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

    def complete(self, prompts: Sequence[str]) -> List[str]:
        import torch

        out: List[str] = []
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "left"
        try:
            for i in range(0, len(prompts), self.batch_size):
                enc = self.tokenizer([judge_text(self.tokenizer, p) for p in prompts[i:i + self.batch_size]], return_tensors="pt",
                                     padding=True, add_special_tokens=False).to(self.model.device)
                with torch.no_grad():
                    ids = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                              pad_token_id=self.tokenizer.pad_token_id)
                out.extend(self.tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True))
        finally:
            self.tokenizer.padding_side = side
        return out


class RolloutJudge:
    """Greedy verdicts from the run's own rollout engine (``bind``: the trainer's engine and tokenizer): the
    batch's judge prompts in one ``engine.generate`` call. The torch RNG state is restored after the call, so
    the rollout's sampling goes on as without the judge; the engine's weights are read, never written."""

    def __init__(self, max_new_tokens: int = 64):
        self.max_new_tokens = max_new_tokens
        self.engine: Any = None
        self.tokenizer: Any = None
        self.calls = 0  # engine calls made

    def bind(self, engine: Any, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer

    def complete(self, prompts: Sequence[str]) -> List[str]:
        import torch

        from verl_fast.records.generation import SamplingSpec

        if self.engine is None:
            raise ValueError("reward_fn.judge.engine=rollout judges on the trainer's rollout engine, and none is bound "
                             "(RLTrainer binds it; alone, call bind_engine(reward, engine, tokenizer))")
        ids = [list(self.tokenizer(judge_text(self.tokenizer, p), add_special_tokens=False)["input_ids"])
               for p in prompts]
        spec = SamplingSpec(n=1, temperature=0.0, max_tokens=self.max_new_tokens, logprobs=False)
        cpu = torch.random.get_rng_state()
        gpu = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            out = self.engine.generate(ids, spec)
        finally:
            torch.random.set_rng_state(cpu)
            if gpu is not None:
                torch.cuda.set_rng_state_all(gpu)
        self.calls += 1
        texts = [""] * len(prompts)
        for r, i in enumerate(out.prompt_index.tolist()):
            n = int(out.response_mask[r].sum())
            texts[i] = self.tokenizer.decode(out.response_ids[r, :n].tolist(), skip_special_tokens=True)
        return texts


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
        if settings.engine == "rollout":
            backend: Any = RolloutJudge(settings.max_new_tokens)
        elif settings.engine == "url":
            key = os.environ.get(settings.api_key_env) if settings.api_key_env else None
            backend = URLJudge(settings.url, settings.model, key, settings.max_new_tokens, settings.batch_size,
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


def bind_engine(reward: Any, engine: Any, tokenizer: Any) -> bool:
    """Gives the rollout engine to every judge of ``reward`` (a reward function, guarded, or weighted) that
    judges on it; whether there is one (the engine must then stay awake until the reward has scored)."""
    parts = getattr(reward, "parts", None)
    if parts is not None:
        return any([bind_engine(r, engine, tokenizer) for _, _, r in parts])
    inner = getattr(reward, "inner", None)
    if inner is not None:
        return bind_engine(inner, engine, tokenizer)
    if isinstance(reward, JudgeReward) and isinstance(reward.backend, RolloutJudge):
        if engine is None:
            raise ValueError("reward_fn.judge.engine=rollout judges on the rollout engine, and this run has none (an "
                             "offline algorithm); set reward_fn.judge.model_name or url")
        reward.backend.bind(engine, tokenizer)
        return True
    return False


def _check(cfg: config.Config) -> None:
    for key, r in config.keyed_reward_functions(cfg.reward_fn):
        if r.judge and r.type != "judge":
            raise ValueError(f"{key}.judge applies to {key}.type=judge only, got type {r.type}")
        if r.type == "judge":
            parse(r.judge, key)


config.register_check(_check)
