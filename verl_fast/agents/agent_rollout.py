"""Agent rollouts: the user's agent program drives the rollout through an OpenAI-compatible endpoint on
the run's own engine (``agents/endpoint.py``).

Per step, each prompt x ``n`` samples gets a trajectory and a run of ``agent(row, base_url)`` in a thread
of its own (``rollout.server.concurrency`` at once): ``row`` is a dict of the dataset row's columns plus
``messages`` (its prompt as chat messages), ``ground_truth``, ``data_source`` and ``extra_info``;
``base_url`` is the trajectory's ``http://127.0.0.1:<port>/t/<id>/v1``. Every call the agent makes is
recorded as the engine sampled it; the calls that continue each other (``Recorder.chain``) become the
sample's response: the model's tokens trained (``response_mask`` 1), the rendered tool / user messages
between them holes, as in the built-in multi-turn rollout (``agents/rollout.py``).

The agent's return value is a reward (a number, or a dict with ``reward``) added on the last model
token, as an environment's per-turn reward is; ``None`` leaves the score to ``reward_fn`` (which scores
the last call's text). A sample is scored as failed (an empty response: nothing of it trains, and the
reward function scores the empty text) when its agent raises, runs past ``timeout_s`` (its trajectory is
closed: later calls are refused, HTTP 410, or 404 once the step's rollout is over), or never calls the endpoint; each is logged in one line and counted,
and the run goes on. Calls past the token budget (``rollout.max_new_tokens``: model and observation
tokens after the first prompt) are refused with HTTP 400 and counted.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from verl_fast.agents.endpoint import EngineBatcher, Endpoint, Recorder
from verl_fast.agents.environments import row_messages
from verl_fast.agents.rollout import MultiTurnRolloutOperator, Trajectory
from verl_fast.agents.server_settings import ServerConfig
from verl_fast.data import PromptRow
from verl_fast.records.generation import GenerationOutput, SamplingSpec
from verl_fast.rollout.base import RolloutEngine
from verl_fast.rollout.operator import RolloutOperator

logger = logging.getLogger(__name__)

_TIMEOUT_CHECK_S = 0.05  # the rollout looks for runs past timeout_s this often (and whenever a run ends)


@dataclass
class _Run:
    """One agent run: its trajectory's id, and how the run ended."""

    row: int
    sample: int
    tid: str
    start: float = 0.0
    done: bool = False
    released: bool = False  # its concurrency slot given back (at its end, or at its timeout)
    result: Any = None
    error: Optional[str] = None  # crashed: the exception, one line


def _reward_of(result: Any) -> Optional[float]:
    if isinstance(result, dict):
        result = result.get("reward")
    if result is None:
        return None
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        raise TypeError(f"an agent must return a number, a dict with 'reward', or None; got {type(result).__name__}")
    return float(result)


class AgentRolloutOperator(RolloutOperator):
    """A RolloutOperator whose samples are agent runs against the endpoint (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, default: SamplingSpec, tokenizer: Any, agent: Callable[..., Any],
                 settings: ServerConfig, system_prompt: Optional[str] = None):
        super().__init__(engine, default)
        self.tokenizer, self.agent, self.settings, self.system_prompt = tokenizer, agent, settings, system_prompt
        self._running = 0  # agent runs started and not yet released
        self._unstarted = 0  # the rollout's runs not yet started
        self.batcher = EngineBatcher(engine, settings.batch_window_s, continuation=settings.kv_continuation,
                                     live=self._live)
        self.endpoint = Endpoint(self.batcher, tokenizer, settings.tool_format, settings.host, settings.port)
        self._slots = threading.Semaphore(settings.concurrency)
        self._release_lock = threading.Lock()
        self._ended = threading.Event()  # a run ended (or timed out) since the rollout's loop last looked
        self._metrics: Dict[str, float] = {}

    def _row(self, row: PromptRow) -> Dict[str, Any]:
        return {**row.columns, "messages": row_messages(row, self.system_prompt), "ground_truth": row.ground_truth,
                "data_source": row.data_source, "extra_info": dict(row.extra_info)}

    def _live(self) -> int:
        """The runs that may call the endpoint now or at once: those going, and those about to start
        into the free slots."""
        return self._running + min(self._unstarted, self.settings.concurrency - self._running)

    def _release(self, run: _Run) -> None:
        with self._release_lock:
            if run.released:
                return
            run.released = True
            self._running -= 1
            self._slots.release()
        self._ended.set()
        self.batcher.wake()  # one agent fewer to wait for

    def _start(self, run: _Run, row: Dict[str, Any], url: str, runs: List[_Run]) -> None:
        def body() -> None:
            try:
                run.result = self.agent(row, url)
                _reward_of(run.result)
            except Exception as e:  # noqa: BLE001 - the user's agent failed: the sample is scored as failed
                run.error = run.error or f"{type(e).__name__}: {e}"
            finally:
                run.done = True
                self._release(run)

        while not self._slots.acquire(timeout=0.05):  # a run past its time gives its slot back
            self._check_timeouts(runs)
        run.start = time.monotonic()
        with self._release_lock:
            self._running += 1
            self._unstarted -= 1
        threading.Thread(target=body, name=f"verl_fast agent {run.tid}", daemon=True).start()

    def _check_timeouts(self, runs: List[_Run]) -> bool:
        """Closes the trajectories of runs past ``timeout_s``; whether any run is still going."""
        now, going = time.monotonic(), False
        for r in runs:
            if r.done or r.error is not None or not r.start:
                continue
            if now - r.start > self.settings.timeout_s:
                r.error = f"timed out after rollout.server.timeout_s={self.settings.timeout_s:g} s"
                self.endpoint.close_trajectory(r.tid, "timeout")
                self._release(r)
            else:
                going = True
        return going

    def rollout(self, batch: Sequence[PromptRow], seed: Optional[int] = None) -> GenerationOutput:
        started = time.perf_counter()
        calls0, seconds0 = self.batcher.calls, self.batcher.seconds
        self.batcher.begin()
        try:
            out, counts = self._run_agents(batch, seed)
        finally:
            self.batcher.end()
        counts.update({"engine_calls": self.batcher.calls - calls0, "engine_seconds": self.batcher.seconds - seconds0,
                       "seconds": time.perf_counter() - started, **self.batcher.prefill})
        self._metrics = {f"agent/{k}": float(v) for k, v in counts.items()}
        return out

    def _run_agents(self, batch: Sequence[PromptRow], seed: Optional[int]) -> Tuple[GenerationOutput, Dict[str, float]]:
        """Every sample's agent run, to its end or timeout; their trajectories and counts."""
        runs: List[_Run] = []
        specs = self.specs(batch, seed)
        self._unstarted = sum(spec.n for spec in specs)
        for i, (row, spec) in enumerate(zip(batch, specs)):
            payload = self._row(row)
            for k in range(spec.n):
                run = _Run(i, k, uuid.uuid4().hex[:12])
                sample = replace(spec, n=1, seed=None if spec.seed is None else spec.seed * 1009 + k)
                url = self.endpoint.open(run.tid, sample)
                runs.append(run)
                self._start(run, dict(payload), url, runs)
        while self._check_timeouts(runs):
            self._ended.wait(_TIMEOUT_CHECK_S)
            self._ended.clear()
        return self._output(runs, batch)

    def _output(self, runs: List[_Run], batch: Sequence[PromptRow]) -> Tuple[GenerationOutput, Dict[str, float]]:
        counts = {"failed": 0, "crashed": 0, "timeouts": 0, "no_calls": 0, "calls": 0, "calls_dropped": 0,
                  "refused_calls": 0}
        trajectories = []
        name = getattr(self.agent, "__name__", "agent")
        for run in runs:
            rec = self.endpoint.pop(run.tid)
            chain = rec.chain()
            counts["calls"] += len(rec.calls)
            counts["calls_dropped"] += len(rec.calls) - len(chain)
            counts["refused_calls"] += rec.refused
            why = self._failure(run, rec)
            if why is not None:
                counts["failed"] += 1
                counts[why[0]] += 1
                logger.warning("agent %s, prompt %d sample %d: %s; scored as failed", name, run.row, run.sample, why[1])
                trajectories.append(Trajectory(run.row, None, list(batch[run.row].prompt_ids), None))
                continue
            trajectories.append(_trajectory(run, chain, _reward_of(run.result)))
        return MultiTurnRolloutOperator._output(self, trajectories), counts  # the same padded layout

    @staticmethod
    def _failure(run: _Run, rec: Recorder) -> Optional[Tuple[str, str]]:
        if run.error is not None:
            kind = "timeouts" if rec.closed == "timeout" else "crashed"
            return kind, run.error
        if not rec.calls:
            return "no_calls", "it never called the endpoint"
        return None

    def metrics(self) -> Dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        self.endpoint.close()
        self.batcher.close()


def _trajectory(run: _Run, chain: List[Any], reward: Optional[float]) -> Trajectory:
    """The chain's calls as one trajectory: the first prompt, then per call the tokens between (a hole)
    and the sampled tokens (trained), with their log-probs."""
    first = chain[0].prompt_ids
    t = Trajectory(run.row, None, list(first), None)
    for call in chain:
        obs = call.prompt_ids[len(first) + len(t.ids):]
        t.ids += obs + call.ids
        t.mask += [0] * len(obs) + [1] * len(call.ids)
        t.logprobs += [0.0] * len(obs) + list(call.logprobs)
        t.turn_ends.append(max(len(t.ids) - 1, 0))
    t.last_text, t.finish = chain[-1].text, chain[-1].finish
    if reward is not None:
        t.rewards.append((t.turn_ends[-1], reward))
    return t


def build_operator(cfg: Any, engine: RolloutEngine, tokenizer: Any, default: SamplingSpec,
                   agent: Optional[Callable[..., Any]] = None) -> Optional[AgentRolloutOperator]:
    """The run's agent operator, or None when neither ``rollout.server`` nor ``agent`` is given."""
    from verl_fast.agents import server_settings
    from verl_fast.agents.tools import load_tool

    settings = server_settings.parse(cfg.rollout)
    if settings is None and agent is None:
        return None
    settings = settings or server_settings.ServerConfig()
    if agent is None:
        if settings.agent is None:
            raise ValueError("rollout.server needs an agent: rollout.server.agent (module:function) or "
                             "RLTrainer(agent=f)")
        agent = load_tool(settings.agent)
    if engine.collective:
        raise ValueError("rollout.server is not supported with a collective engine (vLLM under torchrun); use "
                         "rollout.type=hf there, or one process")
    return AgentRolloutOperator(engine, default, tokenizer, agent, settings, system_prompt=cfg.trainer.system_prompt)
