"""An OpenAI-compatible HTTP endpoint on the run's own rollout engine, for agent programs: every call is
recorded as the token ids and log-probs the engine sampled (never re-tokenised), per trajectory.

Each trajectory has its own base URL, ``http://127.0.0.1:<port>/t/<id>/v1``, so any client works
(``openai.OpenAI(base_url=...)``, a plain ``requests`` / urllib loop). Served: ``POST /chat/completions``
(``messages``, ``tools``, ``tool_choice`` ``auto`` / ``none``, ``n``, ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``logprobs``), ``POST /completions``
(``prompt`` as text or token ids) and ``GET /models``.

Requests from all trajectories meet in ``EngineBatcher``: those that arrive within ``batch_window_s`` of
each other go to the engine in one ``generate`` call. A request's handler parses it and finds what its
prompt continues; the batcher renders the prompts of a batch through the chat template and tokenises them
together (``chat.prompts_ids``: each distinct text rendered once, one tokenizer call), as the built-in
multi-turn rollout renders its turns, before the engine call. On the HF decode a trajectory's call that extends
its previous call's prompt and sampled tokens exactly prefills only the new tokens (the previous call's
keys and values kept, ``rollout/kv_turns.py``).

A chat call whose messages repeat the trajectory's previous call and the assistant message returned to
it, then add tool / user messages, continues that call's tokens: its prompt is the previous prompt, the
sampled tokens, and the new messages rendered through the chat template (``agents/chat.py``). A call
that rewrites the history is tokenised whole and starts a new chain; ``Recorder.trajectory`` keeps the
last chain (the calls that continue each other).
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from verl_fast.agents.chat import ChatRenderer, Prompt, prompts_ids, render_key
from verl_fast.agents.parsing import parse_tool_calls
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout.base import RolloutEngine


class Refused(Exception):
    """A request the endpoint answers with an HTTP error (status, one-line message)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


Samples = List[Tuple[List[int], List[float], str]]  # per sample: token ids, their log-probs, finish reason


class _Request(NamedTuple):
    prompt: Prompt  # made token ids when its batch goes, with the batch's other prompts
    sampling: Callable[[List[int]], SamplingSpec]  # the call's sampling, given its prompt ids (or Refused)
    future: Future
    key: Optional[str]  # the trajectory whose cache a one-sample call continues (None: nothing cached)


_WAKE = object()  # put by wake(): the worker looks at live() again


class _Ready(NamedTuple):
    request: _Request
    prompt_ids: List[int]
    spec: SamplingSpec


class EngineBatcher:
    """Calls of many trajectories as few ``generate`` calls: a worker thread takes every request that
    arrives within ``window_s`` of the first (at most ``max_batch``) and generates them together; it goes
    at once when ``live()`` (the agent runs that may still call) says every one of them is waiting in it.
    The batch's prompts are made token ids together first (``chat.prompts_ids``), then each request's
    sampling is fixed from its prompt ids (a request refused there gets its error, the others go).

    Between ``begin()`` and ``end()`` (one rollout: the weights do not change inside it), with
    ``continuation`` on and an engine that keeps conversations' caches (``engine.turn_cache()``, the HF
    decode's ``rollout/kv_turns.py``), a one-sample call of a trajectory continues the keys and values of
    that trajectory's previous call: where its prompt extends the previous prompt and sampled tokens
    exactly, only the new tokens are prefilled; otherwise (a first call, an edited history) the whole
    prompt is. Calls of ``n`` > 1 samples go to ``engine.generate`` (nothing cached)."""

    def __init__(self, engine: RolloutEngine, window_s: float = 0.02, max_batch: int = 256,
                 continuation: bool = True, live: Optional[Callable[[], int]] = None):
        self.engine, self.window_s, self.max_batch, self.live = engine, window_s, max_batch, live
        self.continuation = continuation
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()  # requests, _WAKE, None (stop)
        self.calls, self.seconds = 0, 0.0
        self._turns: Any = None  # the rollout's TurnCache, between begin() and end()
        self._turns_lock = threading.Lock()  # the worker's decodes against drop() / end() of other threads
        self.prefill: Dict[str, float] = {}  # the last rollout's prefill_tokens (fed) and prefill_tokens_saved
        self._fed_whole = 0  # tokens the rollout's calls prefilled whole (not through the TurnCache)
        self._thread = threading.Thread(target=self._loop, name="verl_fast endpoint engine", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        """A rollout starts: conversations' caches are kept from now (where the engine keeps them)."""
        with self._turns_lock:
            self._turns = self.engine.turn_cache() if self.continuation else None
            self.prefill, self._fed_whole = {}, 0

    def end(self) -> None:
        """The rollout is over: every cache freed, its prefill counts kept in ``prefill``."""
        with self._turns_lock:
            cached = self._turns.metrics() if self._turns is not None else {}
            self.prefill = {"prefill_tokens": self._fed_whole + cached.get("prefill_tokens", 0.0),
                            "prefill_tokens_saved": cached.get("prefill_tokens_saved", 0.0)}
            if self._turns is not None:
                self._turns.close()
            self._turns = None

    def drop(self, key: str) -> None:
        """Frees trajectory ``key``'s cache (it makes no more calls)."""
        with self._turns_lock:
            if self._turns is not None:
                self._turns.drop(key)

    def generate(self, prompt: Prompt, sampling: Callable[[List[int]], SamplingSpec], key: Optional[str] = None
                 ) -> Tuple[List[int], Samples]:
        """The prompt's token ids and ``spec.n`` samples of them, ``spec = sampling(prompt ids)`` (its
        exception raised here). ``key``: the trajectory whose cache a one-sample call continues (None:
        nothing cached)."""
        future: Future = Future()
        self._queue.put(_Request(prompt, sampling, future, key))
        return future.result()

    def wake(self) -> None:
        """``live()`` fell (a run ended): a batch that waits for it may go."""
        self._queue.put(_WAKE)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            if first is _WAKE:
                continue
            batch, deadline = [first], time.monotonic() + self.window_s
            while len(batch) < self.max_batch and not self._everyone_waits(len(batch)):
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                if item is not _WAKE:
                    batch.append(item)
            self._run(batch)

    def _everyone_waits(self, waiting: int) -> bool:
        return self.live is not None and waiting >= self.live()

    def _run(self, requests: List[_Request]) -> None:
        batch = self._prepare(requests)
        with self._turns_lock:
            turns = self._turns
            cached = [r for r in batch if turns is not None and r.request.key is not None and r.spec.n == 1]
            whole = [r for r in batch if turns is None or r.request.key is None or r.spec.n != 1]
            if cached:
                keys = [r.request.key for r in cached]
                self._call(cached, lambda prompts, specs: turns.generate(keys, prompts, specs))
            if whole:
                self._fed_whole += sum(len(r.prompt_ids) for r in whole)  # a call's n samples share its prefill
                self._call(whole, self.engine.generate)

    @staticmethod
    def _prepare(requests: List[_Request]) -> List[_Ready]:
        """The requests' prompt ids (made together) and sampling; a request whose rendering or sampling
        fails gets its error and stays out."""
        try:
            made = prompts_ids([r.prompt for r in requests])
        except Exception as e:  # noqa: BLE001 - the tokenizer failed on the batch: each request gets the error
            made = [e] * len(requests)
        ready = []
        for r, ids in zip(requests, made):
            try:
                if isinstance(ids, Exception):
                    raise ids
                ready.append(_Ready(r, ids, r.sampling(ids)))
            except Exception as e:  # noqa: BLE001 - the request's handler answers with it
                r.future.set_exception(e)
        return ready

    def _call(self, batch: List[_Ready], run: Any) -> None:
        """One engine call for ``batch``; each request's future gets its prompt ids and samples (or the
        engine's error)."""
        try:
            start = time.perf_counter()
            out = run([r.prompt_ids for r in batch], [r.spec for r in batch])
            self.seconds += time.perf_counter() - start
            self.calls += 1
        except Exception as e:  # noqa: BLE001 - every waiting request gets the engine's error
            for r in batch:
                r.request.future.set_exception(e)
            return
        rows: Dict[int, Samples] = {}
        for r, i in enumerate(out.prompt_index.tolist()):
            n = int(out.response_mask[r].sum())
            ids = out.response_ids[r, :n].tolist()
            logprobs = out.logprobs[r, :n].tolist() if out.logprobs is not None else [0.0] * n
            reason = out.finish_reasons[r] if out.finish_reasons else "stop"
            rows.setdefault(i, []).append((ids, logprobs, reason))
        for i, r in enumerate(batch):
            r.request.future.set_result((r.prompt_ids, rows.get(i, [])))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


@dataclass
class Call:
    """One sampled completion as the trajectory keeps it."""

    prompt_ids: List[int]
    ids: List[int]
    logprobs: List[float]
    finish: str
    messages: Optional[List[Dict[str, Any]]] = None  # chat calls: the request's messages
    reply: Optional[Dict[str, Any]] = None  # chat calls: the assistant message returned
    prompt_text: Optional[str] = None  # completion calls: the prompt as text, when it was text
    text: str = ""


@dataclass
class Recorder:
    """The calls of one trajectory, and what ended it."""

    spec: SamplingSpec  # the sample's sampling: max_tokens bounds the model and observation tokens after the prompt
    key: Optional[str] = None  # the trajectory's id: its engine cache's key
    calls: List[Call] = field(default_factory=list)
    renderer: Optional[ChatRenderer] = None
    closed: Optional[str] = None  # why no more calls are served (timeout, finished)
    refused: int = 0  # calls refused (token budget, unsupported arguments)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def chain(self) -> List[Call]:
        """The last run of calls each of which continues the one before (its prompt extends the
        previous prompt and sampled tokens)."""
        out: List[Call] = []
        for call in self.calls:
            if out and call.prompt_ids[:len(out[-1].prompt_ids) + len(out[-1].ids)] == out[-1].prompt_ids + out[-1].ids:
                out.append(call)
            else:
                out = [call]
        return out

    def used(self, prompt_ids: List[int]) -> int:
        """What a call on ``prompt_ids`` finds spent of the budget: the tokens sampled over all calls, or
        the response the trajectory would hold (observations included), whichever is more."""
        chain = self.chain()
        held = len(prompt_ids) - len(chain[0].prompt_ids) if chain else 0
        return max(held, sum(len(c.ids) for c in self.calls))


def _text_prompt(head: List[int], text: str, tokenizer: Any) -> Prompt:
    """``head`` then ``text`` as the tokenizer encodes it alone."""
    return Prompt(head, (lambda: text) if text else None, ("text", text), tokenizer)


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "")


def _tool_call_json(call: Any) -> Dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}


_RENDERERS_KEPT = 64  # distinct tool sets whose renderers the endpoint keeps


class _Server(ThreadingHTTPServer):
    """A thread per open connection, and a listen backlog for every trajectory of a rollout connecting at
    once (past socketserver's default of 5 pending connections the system drops or resets the rest).

    A thread whose connection closed waits for the next one: a client that opens a connection per call
    (urllib) is served by an idle thread, handed the connection through a queue, rather than by a thread
    started for it (a start waits for the new thread to run, behind every other thread holding the GIL).
    The threads are daemons: a connection a client keeps open holds no exit."""

    daemon_threads = True
    request_queue_size = socket.SOMAXCONN

    def __init__(self, *args: Any, **kwargs: Any):
        self._idle, self._idle_lock, self._closed = 0, threading.Lock(), False  # _idle: threads in _connections
        self._connections: "queue.SimpleQueue[Optional[Tuple[Any, Any]]]" = queue.SimpleQueue()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._idle_lock:
            reuse = self._idle > 0
            self._idle -= reuse
        if reuse:
            self._connections.put((request, client_address))
        else:
            threading.Thread(target=self._serve, args=(request, client_address), name="verl_fast endpoint handler",
                             daemon=True).start()

    def _serve(self, request: Any, client_address: Any) -> None:
        while True:
            self.process_request_thread(request, client_address)  # answers, then closes the connection
            with self._idle_lock:
                if self._closed:
                    return
                self._idle += 1
            item = self._connections.get()
            if item is None:
                return
            request, client_address = item

    def server_close(self) -> None:
        super().server_close()
        with self._idle_lock:
            idle, self._idle, self._closed = self._idle, 0, True
        for _ in range(idle):
            self._connections.put(None)


class Endpoint:
    """The HTTP server (``host``, ``port`` 0: any free one) over ``batcher``, rendering with ``tokenizer``.
    ``open(tid, spec)`` registers a trajectory sampled as ``spec`` (a request's arguments override it) and
    returns its base URL."""

    def __init__(self, batcher: EngineBatcher, tokenizer: Any, tool_format: str = "auto", host: str = "127.0.0.1",
                 port: int = 0, model_name: str = "policy"):
        self.batcher, self.tokenizer = batcher, tokenizer
        self.tool_format, self.model_name = tool_format, model_name
        self.trajectories: Dict[str, Recorder] = {}
        self._renderers: Dict[str, ChatRenderer] = {}  # by the tools' JSON, the most recently used last
        self._pieces: Dict[int, str] = {}  # a token's text alone, as the log-probs name it
        self._lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # an answer leaves in one write (status, headers and body buffered, flushed after do_*): each
            # socket call gives up the GIL and waits for it back behind the other agents' threads
            wbufsize = -1
            disable_nagle_algorithm = True  # a body past the buffer is not held back for the headers' ACK

            def do_GET(self):  # noqa: N802 - http.server's name
                endpoint._answer(self, None)

            def do_POST(self):  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                endpoint._answer(self, self.rfile.read(length) if length else b"")

            def log_message(self, *args):
                pass

        self.server = _Server((host, port), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, name="verl_fast endpoint", daemon=True)
        self._thread.start()
        self.host, self.port = self.server.server_address[:2]

    def open(self, tid: str, spec: SamplingSpec) -> str:
        with self._lock:
            self.trajectories[tid] = Recorder(spec, key=tid)
        return f"http://{self.host}:{self.port}/t/{tid}/v1"

    def close_trajectory(self, tid: str, why: str) -> None:
        with self._lock:
            rec = self.trajectories.get(tid)
        if rec is not None and rec.closed is None:
            rec.closed = why
            self.batcher.drop(tid)

    def pop(self, tid: str) -> Recorder:
        with self._lock:
            rec = self.trajectories.pop(tid)
        self.batcher.drop(tid)
        return rec

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ requests

    def _answer(self, handler: BaseHTTPRequestHandler, body: Optional[bytes]) -> None:
        try:
            status, reply = 200, self._route(handler.path, body)
        except Refused as e:
            status, reply = e.status, {"error": {"message": str(e), "type": "invalid_request_error"}}
        except Exception as e:  # noqa: BLE001 - the agent reads the engine's failure; the run sees it too
            status, reply = 500, {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}}
        data = json.dumps(reply).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)  # sent when handle_one_request flushes the buffer

    def _route(self, path: str, body: Optional[bytes]) -> Dict[str, Any]:
        parts = path.split("?")[0].strip("/").split("/")
        if len(parts) < 4 or parts[0] != "t" or parts[2] != "v1":
            raise Refused(404, f"no such endpoint {path}; a trajectory's base URL is /t/<id>/v1")
        with self._lock:
            rec = self.trajectories.get(parts[1])
        if rec is None:
            raise Refused(404, f"no open trajectory {parts[1]!r}")
        route = "/".join(parts[3:])
        if route == "models" and body is None:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}
        if body is None or route not in ("chat/completions", "completions"):
            raise Refused(404, f"no such endpoint {path}")
        if rec.closed:
            raise Refused(410, f"trajectory {parts[1]} is closed ({rec.closed})")
        try:
            request = json.loads(body)
        except ValueError:
            raise Refused(400, "the request body is not JSON") from None
        if not isinstance(request, dict):
            raise Refused(400, "the request body must be a JSON object")
        with rec.lock:  # one call of a trajectory at a time: its calls form one history
            return self._chat(rec, request) if route == "chat/completions" else self._completion(rec, request)

    def _sampling(self, rec: Recorder, request: Dict[str, Any]) -> Callable[[List[int]], SamplingSpec]:
        """The request's sampling arguments, checked now; the returned function bounds its ``max_tokens``
        by what the token budget leaves once the prompt's ids are known (in the batch)."""
        unsupported = [k for k in ("response_format", "guided_json", "logit_bias") if request.get(k)]
        if unsupported:
            raise Refused(400, f"{unsupported[0]} is not supported: RL samples from the policy unconstrained")
        base = rec.spec
        asked = request.get("max_completion_tokens") or request.get("max_tokens") or base.max_tokens
        stop = request.get("stop") or ()
        # a seed of its own per call, as the built-in multi-turn rollout's per turn
        seed = request.get("seed", None if base.seed is None else base.seed + 7919 * len(rec.calls))
        try:
            spec = replace(base, n=int(request.get("n", 1)), max_tokens=int(asked),
                           temperature=float(request.get("temperature", base.temperature)),
                           top_p=float(request.get("top_p", base.top_p)),
                           stop=(stop,) if isinstance(stop, str) else tuple(stop), seed=seed, logprobs=True)
            spec.validate()
        except (TypeError, ValueError) as e:
            raise Refused(400, f"bad sampling argument: {e}") from None

        def within_budget(prompt_ids: List[int]) -> SamplingSpec:
            left = base.max_tokens - rec.used(prompt_ids)
            if left <= 0:
                rec.refused += 1
                raise Refused(400, f"the trajectory's token budget (rollout.max_new_tokens={base.max_tokens}) "
                              "is spent")
            return replace(spec, max_tokens=min(spec.max_tokens, left))

        return within_budget

    def _renderer(self, tools: List[Dict[str, Any]]) -> ChatRenderer:
        """The renderer of ``tools``, shared by the trajectories calling with the same tools (their prompts
        rendered once per batch where equal)."""
        key = json.dumps(tools, sort_keys=True)
        with self._lock:
            renderer = self._renderers.pop(key, None)
        if renderer is None:
            renderer = ChatRenderer(self.tokenizer, tools, self.tool_format)
        with self._lock:
            self._renderers[key] = renderer  # the most recent last: the oldest of too many goes first
            while len(self._renderers) > _RENDERERS_KEPT:
                self._renderers.pop(next(iter(self._renderers)))
        return renderer

    def _chat(self, rec: Recorder, request: Dict[str, Any]) -> Dict[str, Any]:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise Refused(400, "messages must be a non-empty list of {role, content} objects")
        choice = request.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise Refused(400, f"tool_choice {choice!r} is not supported: RL samples from the policy unconstrained "
                          "(use auto or none)")
        tools = [] if choice == "none" else list(request.get("tools") or [])
        if rec.renderer is None or rec.renderer.schemas != tools:
            rec.renderer = self._renderer(tools)
        prompt, previous = self._continued(rec, messages)
        prompt_ids, samples = self.batcher.generate(prompt, self._sampling(rec, request), rec.key)
        choices = []
        for k, (ids, logprobs, reason) in enumerate(samples):
            stop_token = ids[-1] if ids and reason == "stop" else None
            own = ids[:-1] if stop_token is not None else ids
            calls = parse_tool_calls(self.tokenizer.decode(own, skip_special_tokens=False), rec.renderer.format
                                     ) if tools else []
            reply: Dict[str, Any] = {"role": "assistant",
                                     "content": self.tokenizer.decode(own, skip_special_tokens=True)}
            if calls:
                reply["tool_calls"] = [_tool_call_json(c) for c in calls if c.error is None]
            rec.calls.append(Call(prompt_ids, ids, logprobs, reason, messages=list(messages), reply=reply,
                                  text=reply["content"]))
            choice_out: Dict[str, Any] = {"index": k, "message": reply,
                                          "finish_reason": "tool_calls" if reply.get("tool_calls") else reason}
            if request.get("logprobs"):
                choice_out["logprobs"] = {"content": [
                    {"token": self._piece(t), "logprob": lp, "top_logprobs": []}
                    for t, lp in zip(ids, logprobs)]}
            choice_out["token_ids"] = ids
            choices.append(choice_out)
        return self._envelope("chat.completion", choices, prompt_ids, previous)

    def _continued(self, rec: Recorder, messages: List[Dict[str, Any]]) -> Tuple[Prompt, bool]:
        """The prompt: the previous chat call's prompt and sampled tokens plus the new messages where
        ``messages`` continue it (True), else the whole history rendered (False)."""
        renderer, latest = rec.renderer, rec.calls[-1].prompt_ids if rec.calls else None
        for call in reversed(rec.calls):  # the latest request's choices (n of them)
            if call.messages is None or call.prompt_ids != latest:
                break
            k = len(call.messages)
            if (len(messages) > k + 1 and all(_same(a, b) for a, b in zip(messages[:k], call.messages))
                    and _same(messages[k], call.reply) and all(m.get("role") != "assistant" for m in messages[k + 1:])):
                stop_token = call.ids[-1] if call.ids and call.finish == "stop" else None
                rest = messages[k + 1:]
                return Prompt(call.prompt_ids + call.ids, lambda: renderer.observation_text(rest, stop_token),
                              (renderer, "observations", render_key(rest, stop_token)), self.tokenizer), True
        return Prompt([], lambda: renderer.prompt_text(messages), (renderer, "prompt", render_key(messages)),
                      self.tokenizer), False

    def _piece(self, token: int) -> str:
        """``tokenizer.decode([token])``, decoded once per token id."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.tokenizer.decode([token])
        return piece

    def _completion(self, rec: Recorder, request: Dict[str, Any]) -> Dict[str, Any]:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            made, text = Prompt(list(prompt)), None
        elif isinstance(prompt, str) and prompt:
            text = prompt
            made = self._completion_prefix(rec, prompt)
        else:
            raise Refused(400, "prompt must be a non-empty string or a list of token ids")
        prompt_ids, samples = self.batcher.generate(made, self._sampling(rec, request), rec.key)
        choices = []
        for k, (ids, logprobs, reason) in enumerate(samples):
            out_text = self.tokenizer.decode(ids, skip_special_tokens=True)
            rec.calls.append(Call(prompt_ids, ids, logprobs, reason, prompt_text=text, text=out_text))
            choice_out: Dict[str, Any] = {"index": k, "text": out_text, "finish_reason": reason, "token_ids": ids}
            if request.get("logprobs") is not None:
                choice_out["logprobs"] = {"tokens": [self._piece(t) for t in ids],
                                          "token_logprobs": list(logprobs)}
            choices.append(choice_out)
        return self._envelope("text_completion", choices, prompt_ids, False)

    def _completion_prefix(self, rec: Recorder, prompt: str) -> Prompt:
        """A text prompt that extends the previous completion call's prompt and text keeps their tokens."""
        for call in reversed(rec.calls[-1:]):
            if call.prompt_text is not None:
                before = call.prompt_text + self.tokenizer.decode(call.ids, skip_special_tokens=False)
                if prompt.startswith(before):
                    rest = prompt[len(before):]
                    return _text_prompt(call.prompt_ids + call.ids, rest, self.tokenizer)
        return _text_prompt([], prompt, self.tokenizer)

    def _envelope(self, kind: str, choices: List[Dict[str, Any]], prompt_ids: Sequence[int], continued: bool
                  ) -> Dict[str, Any]:
        generated = sum(len(c["token_ids"]) for c in choices)
        return {"id": f"verl_fast-{time.monotonic_ns()}", "object": kind, "created": int(time.time()),
                "model": self.model_name, "choices": choices, "continued": continued,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": generated,
                          "total_tokens": len(prompt_ids) + generated}}
