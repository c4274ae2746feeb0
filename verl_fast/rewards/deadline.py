"""A reward batch scored in a worker thread that the trainer can stop waiting for.

A user's scorer may never return (a hung request, an infinite loop), raise SystemExit or
KeyboardInterrupt, or ignore signals; none of that may wedge the trainer or end it without a
checkpoint. So the batch runs in a daemon thread while the trainer's thread waits:

- it returns in time: its scores (or its exception) come back as from a plain call;
- ``timeout_s`` passes first (``reward_fn.timeout_s``, per batch): ``RewardTimeout``, naming the
  reward and the sample count; the trainer checkpoints its last complete step and stops;
- a stop is requested (the first SIGTERM / Ctrl-C sets ``stop``): the reward gets ``STOP_GRACE_S``
  more to finish, so that the step completes as a signal asks; past that, ``RewardStopped`` and the
  trainer checkpoints the last complete step and returns, as for any signal;
- the scorer raises SystemExit or KeyboardInterrupt: ``RewardStopped`` as well (handled like that
  signal, never a silent exit).

A thread cannot be killed: one that was stopped waiting for keeps running, as a daemon, until it
returns or the process ends (the trainer stops after either error). ``timeout_s=None`` scores in the
calling thread (for scorers that need the main thread, e.g. ones using ``signal.alarm``): no limit
then, and a signal waits for the reward to return.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Optional

# how long a reward still scoring when a stop is requested may take to finish the step (preemption
# usually allows ~30 s in all, and the checkpoint needs its share)
STOP_GRACE_S = 5.0


class RewardTimeout(RuntimeError):
    """A reward batch took longer than ``reward_fn.timeout_s``."""


class RewardStopped(Exception):
    """The step cannot finish: a stop was requested while the reward ran (and it did not return
    within the grace period), or the reward raised SystemExit / KeyboardInterrupt. ``exit_code``: what
    the command exits with after the checkpoint (0 for a signal's stop; a reward's ``sys.exit(n)``:
    n, or 1 when n is 0 or not a number, since the run did not finish; KeyboardInterrupt: 130)."""

    def __init__(self, message: str, exit_code: int = 0) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def score(fn: Callable[[], Any], name: str, count: int, timeout_s: Optional[float],
          stop: Optional[threading.Event] = None) -> Any:
    """``fn()`` (one batch of ``count`` samples of reward ``name``) under the rules above."""
    if timeout_s is None:
        return _unwrapped(_run(fn), name, count)
    box: Dict[str, Any] = {}
    done = threading.Event()

    def work() -> None:
        box.update(_run(fn))
        done.set()

    threading.Thread(target=work, name=f"reward {name}", daemon=True).start()
    start = time.monotonic()
    stopped_at: Optional[float] = None
    while not done.wait(0.05):
        now = time.monotonic()
        if now - start >= timeout_s:
            raise RewardTimeout(f"reward function {name} did not return within reward_fn.timeout_s={timeout_s:g} s "
                                f"for a batch of {count} samples")
        if stop is not None and stop.is_set():
            stopped_at = now if stopped_at is None else stopped_at
            if now - stopped_at >= STOP_GRACE_S:
                raise RewardStopped(f"a stop was requested while reward function {name} scored a batch of {count} "
                                    f"samples, and it did not return within {STOP_GRACE_S:g} s: the step is "
                                    "abandoned")
    return _unwrapped(box, name, count)


def _run(fn: Callable[[], Any]) -> Dict[str, Any]:
    try:
        return {"value": fn()}
    except BaseException as e:  # noqa: BLE001 - SystemExit / KeyboardInterrupt too: handed to the waiter
        return {"error": e}


def _unwrapped(box: Dict[str, Any], name: str, count: int) -> Any:
    error = box.get("error")
    if isinstance(error, (SystemExit, KeyboardInterrupt)):
        if isinstance(error, SystemExit):
            what = f"SystemExit({error.code!r})"
            code = error.code if isinstance(error.code, int) and not isinstance(error.code, bool) and error.code else 1
        else:
            what, code = "KeyboardInterrupt", 130
        raise RewardStopped(f"reward function {name} raised {what} while scoring a batch of {count} samples: "
                            f"handled as a stop request (the step is abandoned; exit code {code})",
                            exit_code=code) from error
    if error is not None:
        raise error
    return box["value"]
