"""Multi-turn rollout: each sample is a trajectory of model turns and observations (tool results,
environment messages), generated through the run's engine (HF decode or vLLM), trained on the model's
own tokens only.

Per step: every prompt x ``n`` samples gets an environment (``reset(row)``: the first messages,
rendered through the chat template with the tools). Each finished model turn goes to its
environment's ``step`` on a thread pool (tool calls run in the ``ToolExecutor``'s worker processes,
``tool_workers`` at once), so trajectories waiting for a tool do not hold the others:

- an engine that streams (vLLM: ``submit`` / ``step``) gets each trajectory's next turn as soon as its
  observation is in, while the others decode: continuous batching across turns (``_stream``);
- otherwise (HF decode), turn by turn, the trajectories that are ready go in one ``generate`` call
  (``_waves``); a slow tool holds the others no longer than half a generate call (or ``GRACE_S``),
  then its trajectory joins a later call.

Each continues from its own tokens: vLLM's prefix cache reuses them; the HF decode keeps each
trajectory's keys and values between its turns (``engine.turn_cache()``, ``rollout/kv_turns.py``; off with
``kv_continuation: false``) and prefills only the observation after the model's last token. A
trajectory ends when its environment says done (no tool call), after ``max_turns`` model turns, or
when its tokens reach ``rollout.max_new_tokens``.

The output is a ``GenerationOutput`` whose response is everything after the first prompt:
``response_mask`` is 1 on the model's tokens only (observations are holes: masked out of the
log-probs' losses, KL and entropy; GAE and REINFORCE++ carry across them), ``attention_mask`` is 1
on every token, ``turn_ends`` keeps each model turn's last position, ``token_rewards`` holds the
environments' per-turn rewards on those positions, and ``texts`` the final model turn (what the
reward scores).
"""

from __future__ import annotations

import concurrent.futures
import copy
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from verl_fast.agents.chat import ChatRenderer
from verl_fast.agents.environments import (Environment, ReasoningGymEnvironment, SingleTurnEnvironment, StepResult,
                                           ToolEnvironment, custom_environment)
from verl_fast.agents.guarded import GuardedEnvironment
from verl_fast.agents.settings import MultiTurnConfig
from verl_fast.agents.tools import ToolExecutor, tool_schema
from verl_fast.records.prompts import PromptRow
from verl_fast.records.generation import GenerationOutput, SamplingSpec
from verl_fast.rollout.base import RolloutEngine
from verl_fast.rollout.operator import RolloutOperator


# how long the next turn waits for slow observations at least: a straggler holds the others no longer
# than this or half a generate call, whichever is longer (then it joins a later call)
GRACE_S = 0.05


@dataclass
class Trajectory:
    """One sample's tokens so far (the response: everything after ``prompt_ids``)."""

    row: int  # which prompt of the batch
    env: Environment
    prompt_ids: List[int]
    spec: SamplingSpec
    single_turn: bool = False
    ids: List[int] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)  # 1: the model sampled it
    logprobs: List[float] = field(default_factory=list)
    turn_ends: List[int] = field(default_factory=list)  # position (in ids) of each model turn's last token
    rewards: List[Tuple[int, float]] = field(default_factory=list)  # (position, reward) per rewarded turn
    last_text: str = ""  # the latest model turn (special tokens skipped), where ``last_turn`` is None
    last_turn: Optional[List[int]] = None  # the latest model turn's tokens, decoded into the output's text at the end
    stop_token: Optional[int] = None  # the token that ended the latest turn (None: it ran out of tokens)
    finish: str = "stop"
    done: bool = False


class MultiTurnRolloutOperator(RolloutOperator):
    """A RolloutOperator whose samples are trajectories (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, default: SamplingSpec, tokenizer: Any, mt: MultiTurnConfig,
                 tools: Dict[str, Callable[..., Any]], system_prompt: Optional[str] = None,
                 max_num_seqs: Optional[int] = None):
        super().__init__(engine, default, max_num_seqs=max_num_seqs)
        self.mt, self.tokenizer, self.system_prompt = mt, tokenizer, system_prompt
        if mt.environment == "tools" and not tools:
            raise ValueError("rollout.multi_turn.environment=tools needs tools: list them in rollout.multi_turn.tools "
                             "or pass RLTrainer(tools=[...])")
        self._custom = custom_environment(mt.environment) if ":" in mt.environment else None
        schemas = [tool_schema(f) for f in tools.values()]
        if hasattr(self._custom, "tool_schemas"):  # an environment that offers tools of its own (verl's tools)
            schemas += self._custom.tool_schemas(**mt.environment_kwargs)
        self.renderer = ChatRenderer(tokenizer, schemas, mt.tool_format)
        self.executor = ToolExecutor(tools, mt.tool_workers, mt.tool_timeout_s, mt.tool_result_max_bytes,
                                     mt.tool_output_max_bytes) if tools else None
        self._threads = concurrent.futures.ThreadPoolExecutor(max(mt.tool_workers, 1),
                                                              thread_name_prefix="verl_fast env step")
        self._metrics: Dict[str, float] = {}
        self._prefill: Dict[str, float] = {}  # the rollout's prefill counts (TurnCache.metrics)
        # the last rollout's generate calls (HF decode, turn by turn): each call's rows, its seconds, the host
        # seconds since the previous call ended (the first: since the rollout began) and the engine's metrics
        self.calls: List[Dict[str, float]] = []

    # ------------------------------------------------------------------ environments

    def _environment(self, row: PromptRow) -> Tuple[Environment, bool]:
        """``(environment, single_turn)`` of a row: the configured one (under its time limit, where
        ``env_isolation`` asks), or single turn where the row's ``environment`` column (or extra_info
        key) says ``single_turn``."""
        wanted = row.columns.get("environment") or row.extra_info.get("environment") or self.mt.environment
        if wanted == "single_turn":
            return SingleTurnEnvironment(self.system_prompt), True
        if wanted != self.mt.environment:
            raise ValueError(f"a row asks for environment {wanted!r}; this run's is rollout.multi_turn.environment="
                             f"{self.mt.environment} (a row may also ask for single_turn)")
        return GuardedEnvironment(self._make_environment, wanted, self.mt.env_timeout_s, self.mt.env_isolation), False

    def _make_environment(self) -> Environment:
        if self._custom is not None:
            return self._custom(**self.mt.environment_kwargs)
        if self.mt.environment == "reasoning_gym":
            return ReasoningGymEnvironment(system_prompt=self.system_prompt, **self.mt.environment_kwargs)
        return ToolEnvironment(self.executor, self.renderer.format, self.mt.max_tool_calls, self.system_prompt,
                               **self.mt.environment_kwargs)

    def _start(self, batch: Sequence[PromptRow], specs: List[SamplingSpec], out: List[Trajectory]) -> None:
        """Appends every sample's trajectory to ``out`` (its environment reset), the first messages rendered
        and encoded together (each distinct conversation once)."""
        rendered: List[Tuple[Trajectory, List[Dict[str, Any]]]] = []
        for i, (row, spec) in enumerate(zip(batch, specs)):
            for k in range(spec.n):
                env, single = self._environment(row)
                try:
                    messages = env.reset(row)
                except BaseException:
                    _close(env)
                    raise
                # a single-turn row keeps its own prompt tokens: the single-turn rollout's exactly
                sample_seed = None if spec.seed is None else spec.seed * 1009 + k
                out.append(Trajectory(i, env, list(row.prompt_ids) if single else [],
                                      replace(spec, n=1, seed=sample_seed), single_turn=single))
                if not single:
                    rendered.append((out[-1], messages))
        for (t, _), ids in zip(rendered, self.renderer.prompts_ids([m for _, m in rendered])):
            t.prompt_ids = ids

    # ------------------------------------------------------------------ the loop

    def rollout(self, batch: Sequence[PromptRow], seed: Optional[int] = None) -> GenerationOutput:
        start = self._began = time.perf_counter()
        trajectories: List[Trajectory] = []
        self._prefill, self.calls = {}, []
        try:
            self._start(batch, self.specs(batch, seed), trajectories)
            run = self._stream if self.engine.streams else self._waves
            generate_s, calls = run(trajectories)
            self._metrics = self._summary(trajectories, time.perf_counter() - start, generate_s, calls)
        finally:
            for t in trajectories:
                _close(t.env)
        return self._output(trajectories)

    def _turn_spec(self, t: Trajectory) -> SamplingSpec:
        """The sampling of ``t``'s next turn: what is left of its budget, a seed of its own per turn."""
        per_turn = self.mt.max_tokens_per_turn or self.default.max_tokens
        return replace(t.spec, max_tokens=min(per_turn, t.spec.max_tokens - len(t.ids)),
                       seed=None if t.spec.seed is None else t.spec.seed + 7919 * len(t.turn_ends))

    def _waves(self, trajectories: List[Trajectory]) -> Tuple[float, int]:
        """Turn by turn: the ready trajectories in one ``generate`` call (HF decode), each continuing its
        cached keys and values where the engine keeps them. Returns the seconds spent generating and the
        number of calls."""
        turns = self.engine.turn_cache() if self.mt.kv_continuation else None
        if turns is not None:  # the longest conversation: the first turn's cache holds every later turn
            turns.reserve(max((len(t.prompt_ids) + t.spec.max_tokens for t in trajectories), default=0))
        try:
            if turns is not None:  # the engine's decoding state entered once for every turn (released at close)
                turns.hold()
            return self._wave_loop(trajectories, turns)
        finally:
            if turns is not None:
                self._prefill.update(turns.metrics())
                turns.close()

    def _generate(self, ready: List[Trajectory], turns: Any) -> GenerationOutput:
        """The ready trajectories' next turns: continued from their caches (``turns``), or whole."""
        prompts, specs = [t.prompt_ids + t.ids for t in ready], [self._turn_spec(t) for t in ready]
        if turns is not None:
            return turns.generate([id(t) for t in ready], prompts, specs)
        # what a re-prefilling engine feeds: each distinct conversation once
        self._prefill["prefill_tokens"] = self._prefill.get("prefill_tokens", 0.0) + sum(
            len(p) for p in set(map(tuple, prompts)))
        return self.engine.generate(prompts, specs)

    def _wave_loop(self, trajectories: List[Trajectory], turns: Any) -> Tuple[float, int]:
        ready, pending = list(trajectories), {}
        generate_s, calls, ended = 0.0, 0, self._began
        while ready or pending:
            if ready:
                t0 = time.perf_counter()
                out = self._generate(ready, turns)
                t1 = time.perf_counter()
                generate_s += t1 - t0
                calls += 1
                self.calls.append({"rows": float(len(ready)), "generate_s": t1 - t0, "host_s": t0 - ended,
                                   **self.engine.call_metrics(), **(turns.call_metrics() if turns is not None else {})})
                ended = t1
                ids, lengths = out.response_ids.tolist(), out.response_mask.sum(1).tolist()  # one conversion each
                lps = out.logprobs.tolist() if out.logprobs is not None else None
                taken = [(t, ids[row][:n], None if lps is None else lps[row][:n],
                          out.finish_reasons[row] if out.finish_reasons else "stop")
                         for row, (t, n) in enumerate(zip(ready, lengths))]
                for t, message in self._take_turns(taken):
                    pending[self._threads.submit(t.env.step, message)] = t
                for t in ready:
                    if t.done and turns is not None:
                        turns.drop(id(t))
                ready = []
            if pending:
                ready = self._collect(pending, grace=max(GRACE_S, 0.5 * generate_s / max(calls, 1)), turns=turns)
        return generate_s, calls

    def _stream(self, trajectories: List[Trajectory]) -> Tuple[float, int]:
        """Request by request (vLLM): every trajectory's next turn is submitted as soon as its
        observation is in, while the others decode (continuous batching across turns). Returns the
        seconds spent in engine steps and the number of turns submitted."""
        inflight = {self.engine.submit(t.prompt_ids, self._turn_spec(t)): t for t in trajectories}
        pending: Dict[concurrent.futures.Future, Trajectory] = {}
        engine_s, submitted = 0.0, len(inflight)
        while inflight or pending:
            if inflight:
                t0 = time.perf_counter()
                finished = self.engine.step()
                engine_s += time.perf_counter() - t0
                taken = [(inflight.pop(request), toks, logprobs, reason) for request, toks, logprobs, reason in finished]
                for t, message in self._take_turns(taken):
                    pending[self._threads.submit(t.env.step, message)] = t
            if not pending:
                continue
            if inflight:  # the engine has work: take the observations that are in, without waiting
                done = [f for f in pending if f.done()]
            else:
                done, _ = concurrent.futures.wait(list(pending), return_when=concurrent.futures.FIRST_COMPLETED)
            observed = [(pending.pop(future), future.result()) for future in done]
            self._observe(observed)
            for t, _ in observed:
                if not t.done:
                    inflight[self.engine.submit(t.prompt_ids + t.ids, self._turn_spec(t))] = t
                    submitted += 1
        return engine_s, submitted

    def _take_turns(self, taken: Sequence[Tuple[Trajectory, List[int], Optional[List[float]], str]]
                    ) -> List[Tuple[Trajectory, Dict[str, Any]]]:
        """Appends each model turn (its trajectory, its tokens, their log-probs, why it ended) to its trajectory,
        and returns the trajectories whose environment steps next, each with its turn as an assistant message
        (the messages' texts decoded in one call). A single-turn row is then done; any other turn goes to its
        environment's step, also the last one the limits allow (``_observe`` ends it there, its reward kept)."""
        going: List[Trajectory] = []
        own: List[List[int]] = []
        for t, toks, logprobs, reason in taken:
            n = len(toks)
            t.ids += toks
            t.mask += [1] * n
            t.logprobs += list(logprobs) if logprobs is not None else [0.0] * n
            t.turn_ends.append(max(len(t.ids) - 1, 0))
            t.finish = reason
            t.stop_token = toks[-1] if toks and reason == "stop" else None
            t.last_turn = toks  # (its text is decoded once, for the output: only the final turn's is read)
            t.done = t.single_turn
            if not t.done:
                going.append(t)
                own.append(toks[:-1] if t.stop_token is not None else toks)  # the turn's text without its stop token
        texts = self.tokenizer.batch_decode(own, skip_special_tokens=False) if own else []
        return [(t, {"role": "assistant", "content": text}) for t, text in zip(going, texts)]

    def _collect(self, pending: Dict[concurrent.futures.Future, Trajectory], grace: float,
                 turns: Any = None) -> List[Trajectory]:
        """The trajectories whose environment step finished (within ``grace`` seconds of waiting for
        all; at least one), with their observations appended; done ones are dropped (and their cached
        keys and values, ``turns``)."""
        done, _ = concurrent.futures.wait(list(pending), timeout=grace)
        if not done:
            done, _ = concurrent.futures.wait(list(pending), return_when=concurrent.futures.FIRST_COMPLETED)
        ready = []
        # in submission order: a seed's rollout repeats
        observed = [(pending.pop(future), future.result()) for future in [f for f in pending if f in done]]
        self._observe(observed)
        for t, _ in observed:
            if not t.done:
                ready.append(t)
            elif turns is not None:
                turns.drop(id(t))
        return ready

    def _observe(self, observed: List[Tuple[Trajectory, StepResult]]) -> None:
        """Each trajectory's environment step: its reward kept, then its end, or its observation's tokens
        appended (the observations rendered and encoded together, each distinct one once)."""
        going: List[Tuple[Trajectory, List[Dict[str, Any]]]] = []
        for t, result in observed:
            if result.reward is not None:
                t.rewards.append((t.turn_ends[-1], float(result.reward)))
            final = len(t.turn_ends) >= self.mt.max_turns or len(t.ids) >= t.spec.max_tokens
            if result.done or final or not result.messages:
                t.done = True
            else:
                going.append((t, result.messages))
        for (t, _), obs in zip(going, self.renderer.observations_ids([(m, t.stop_token) for t, m in going])):
            room = t.spec.max_tokens - len(t.ids)
            if len(obs) >= room:  # no room left for the model to answer: the observation is cut, the episode ends
                obs, t.done, t.finish = obs[:room], True, "length"
            t.ids += obs
            t.mask += [0] * len(obs)
            t.logprobs += [0.0] * len(obs)

    # ------------------------------------------------------------------ output

    def _output(self, trajectories: List[Trajectory]) -> GenerationOutput:
        order = sorted(range(len(trajectories)), key=lambda j: trajectories[j].row)  # stable: grouped by prompt
        ts = [trajectories[j] for j in order]
        N, L = len(ts), max(1, max(len(t.ids) for t in ts))
        pad = self.engine.pad_token_id
        pad = int(pad if pad is not None else self.tokenizer.pad_token_id or 0)
        # each field in one conversion: the rows right-padded as lists first
        ids = torch.tensor([t.ids + [pad] * (L - len(t.ids)) for t in ts], dtype=torch.int64)
        mask = torch.tensor([t.mask + [0] * (L - len(t.mask)) for t in ts], dtype=torch.int64)
        attn = (torch.arange(L)[None, :] < torch.tensor([len(t.ids) for t in ts])[:, None]).to(torch.int64)
        logp = torch.tensor([t.logprobs + [0.0] * (L - len(t.logprobs)) for t in ts], dtype=torch.float32)
        rewards = torch.zeros((N, L), dtype=torch.float32)
        for r, t in enumerate(ts):
            for pos, value in t.rewards:
                rewards[r, pos] += value
        want_logp = self.default.logprobs
        return GenerationOutput(
            prompt_index=torch.tensor([t.row for t in ts], dtype=torch.int64), response_ids=ids, response_mask=mask,
            logprobs=logp if want_logp else None, texts=[_last_text(self.tokenizer, t) for t in ts],
            finish_reasons=[t.finish for t in ts], attention_mask=attn, prompt_ids=[t.prompt_ids for t in ts],
            turn_ends=[list(t.turn_ends) for t in ts],
            token_rewards=rewards if any(t.rewards for t in ts) else None)

    def _summary(self, ts: List[Trajectory], seconds: float, generate_s: float, calls: int) -> Dict[str, float]:
        n = max(len(ts), 1)
        counts: Dict[str, float] = {}
        for figures in self._threads.map(lambda t: t.env.metrics(), ts):  # (a guarded environment's call waits)
            for k, v in figures.items():
                counts[k] = counts.get(k, 0.0) + float(v)
        model = sum(sum(t.mask) for t in ts)
        total = sum(len(t.ids) for t in ts)
        out = {"multi_turn/turns_mean": sum(len(t.turn_ends) for t in ts) / n,
               "multi_turn/turns_max": float(max((len(t.turn_ends) for t in ts), default=0)),
               "multi_turn/masked_tokens": float(total - model),
               "multi_turn/masked_fraction": (total - model) / max(total, 1),
               "multi_turn/generate_calls": float(calls),
               "multi_turn/generate_seconds": generate_s,
               "multi_turn/seconds": seconds}
        for k, v in list(counts.items()) + list(self._prefill.items()):
            out[f"multi_turn/{k}"] = v
        if "tool_calls" in counts:
            out["multi_turn/tool_calls_per_trajectory"] = counts["tool_calls"] / n
        return out

    def metrics(self) -> Dict[str, float]:
        return dict(self._metrics)

    def with_sampling(self, default: SamplingSpec) -> "MultiTurnRolloutOperator":
        """This operator with another default sampling (validation's), sharing its tool workers and
        threads (its own metrics)."""
        other = copy.copy(self)
        other.default, other._metrics, other._prefill, other.calls = default, {}, {}, []
        return other

    def close(self) -> None:
        self._threads.shutdown(wait=False)
        if self.executor is not None:
            self.executor.close()


def _last_text(tokenizer: Any, t: Trajectory) -> str:
    """The trajectory's latest model turn as text, special tokens skipped."""
    return t.last_text if t.last_turn is None else tokenizer.decode(t.last_turn, skip_special_tokens=True)


def _close(env: Environment) -> None:
    if isinstance(env, GuardedEnvironment):
        env.close()


def build_operator(cfg: Any, engine: RolloutEngine, tokenizer: Any, default: SamplingSpec,
                   tools: Sequence[Any] = ()) -> Optional[MultiTurnRolloutOperator]:
    """The run's multi-turn operator, or None when ``rollout.multi_turn`` is unset and no tools are passed."""
    from verl_fast.agents import settings as mt_config
    from verl_fast.agents.mcp_tools import mcp_tools
    from verl_fast.agents.tools import resolve_tools

    mt = mt_config.parse(cfg.rollout)
    if mt is None and not tools:
        return None
    mt = mt or mt_config.MultiTurnConfig()
    if engine.collective:  # ranks would make different numbers of generate calls
        raise ValueError("rollout.multi_turn is not supported with a collective engine (vLLM under torchrun); use "
                         "rollout.type=hf there, or one process")
    resolved = resolve_tools(list(mt.tools) + list(tools) + mcp_tools(mt.mcp_servers, mt.mcp_start_timeout_s))
    return MultiTurnRolloutOperator(engine, default, tokenizer, mt, resolved, system_prompt=cfg.trainer.system_prompt,
                                    max_num_seqs=cfg.rollout.max_num_seqs)
