"""A step's generated samples scored by the run's reward: the samples as ``RewardInput`` rows, scored on
this thread or on a daemon thread started beside the model passes (``reward_fn.launch_reward_fn_async``),
and one outcome on every rank.

- ``reward_inputs``: a batch of prompts (``PromptRow``) and their generation (``GenerationOutput``) as
  one ``RewardInput`` per sample, with the trainer's step (``TrainerState``).
- ``score`` scores on this thread; ``start`` starts the scoring on a daemon thread (it never holds the
  process at exit) and ``wait`` collects it. The reward's own rules apply inside either: its
  ``timeout_s`` deadline, the stop event (``deadline.py``), ``on_error``, and the figures it keeps
  (``last_metrics``, ``last_errors``).
- Every rank gives up the step together: where one rank's reward stopped (``RewardStopped``) or ran
  out of time (``RewardTimeout``), the others raise ``RewardStopped`` too, since a rank alone would
  wait forever in the update's collectives. Any other error of a reward is raised as it is.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, List, Optional, Sequence

import torch

from verl_fast import distributed
from verl_fast.rewards.deadline import RewardStopped, RewardTimeout
from verl_fast.rewards.interface import RewardInput, TrainerState


def reward_inputs(batch: Sequence[Any], gen: Any, step: int, max_steps: Optional[int]) -> List[RewardInput]:
    """One ``RewardInput`` per sample of ``gen`` (a GenerationOutput of ``batch``'s prompts, each sample
    naming its prompt in ``gen.prompt_index``): the prompt's text, ground truth, data source, extra
    info and columns, the response's text and token ids, and the trainer's ``step`` of ``max_steps``."""
    state = TrainerState(global_step=step, max_steps=max_steps)
    ids = [row[mask.bool()].tolist() for row, mask in zip(gen.response_ids.cpu(), gen.response_mask.cpu())]
    return [RewardInput(prompt=batch[i].prompt_text, response=text, ground_truth=batch[i].ground_truth,
                        data_source=batch[i].data_source, extra_info=batch[i].extra_info, columns=batch[i].columns,
                        completion_ids=ids[j], trainer_state=state,
                        images=None if batch[i].vision is None else batch[i].vision.images)
            for j, (i, text) in enumerate(zip(gen.prompt_index.tolist(), gen.texts))]


def score(reward: Any, samples: Sequence[RewardInput], stop: Optional[threading.Event] = None,
          device: Optional[torch.device] = None) -> torch.Tensor:
    """``reward``'s score of each of ``samples`` on this thread, ``[N]`` float32 on ``device``; a stop or
    a timeout on any rank raises on every rank (module docstring)."""
    return _together(lambda: reward(samples, stop=stop), device)


def start(reward: Any, samples: Sequence[RewardInput],
          stop: Optional[threading.Event] = None) -> concurrent.futures.Future:
    """``reward``'s scoring of ``samples`` started on a daemon thread of its own; ``wait`` collects it."""
    scoring: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:
        try:
            scoring.set_result(reward(samples, stop=stop))
        except BaseException as e:  # noqa: BLE001 - handed to wait() on the calling thread
            scoring.set_exception(e)

    threading.Thread(target=work, name="reward beside the passes", daemon=True).start()
    return scoring


def wait(scoring: concurrent.futures.Future, device: Optional[torch.device] = None) -> torch.Tensor:
    """The scores of a ``start``-ed reward, as ``score`` returns them (the ranks agree here, on the
    calling thread)."""
    return _together(scoring.result, device)


def raise_together(failure: Optional[BaseException]) -> None:
    """Raises ``failure`` (a RewardStopped / RewardTimeout of this rank, or None) on this rank, and a
    ``RewardStopped`` on every other rank of the default group when any rank has one (a collective:
    every rank calls it)."""
    if distributed.world_size() > 1 and distributed.any_rank(failure is not None) and failure is None:
        failure = RewardStopped("another rank stopped in its reward")
    if failure is not None:
        raise failure


def beside_passes(setting: Optional[bool], device: torch.device, reward: Any) -> bool:
    """Whether a reward may score beside the model passes: ``setting`` (``launch_reward_fn_async``; None:
    on a GPU), and a reward that scores off the main thread (not ``timeout_s: null``, not a model on
    the GPU). The algorithm has its own say (``scores_decide_rows``)."""
    if setting is None:
        setting = device.type == "cuda"
    return bool(setting) and reward is not None and bool(reward.scores_off_the_main_thread)


def _together(scores: Callable[[], Sequence[float]], device: Optional[torch.device]) -> torch.Tensor:
    failure: Optional[BaseException] = None
    values: Sequence[float] = ()
    try:
        values = scores()
    except (RewardStopped, RewardTimeout) as e:
        failure = e
    raise_together(failure)
    return torch.tensor(values, dtype=torch.float32, device=device)
