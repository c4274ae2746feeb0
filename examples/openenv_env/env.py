"""The OpenEnv example's environment: guess a number from 1 to 20 in up to three turns, told
"higher" or "lower" after each wrong guess, written against openenv-core's server-side interface
(``Environment[Action, Observation, State]``, a ``Rubric`` for the reward). verl_fast runs it through
``verl_fast.agents.openenv_env:OpenEnvEnvironment``; served with OpenEnv's ``create_app`` (``python
examples/openenv_env/env.py``, port 8000) it is reached by URL instead.
"""

import random
import re
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics import Rubric


class GuessAction(Action):
    message: str  # the model's turn


class GuessObservation(Observation):
    feedback: str


class RightGuess(Rubric):
    """1 for the turn that names the number, else 0."""

    def forward(self, action: GuessAction, observation: GuessObservation) -> float:
        return 1.0 if observation.feedback == "Right!" else 0.0


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session its own instance, no shared state

    def __init__(self, high: int = 20, max_guesses: int = 3):
        super().__init__(rubric=RightGuess())
        self.high, self.max_guesses = high, max_guesses
        self._state = State()
        self.target = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self._reset_rubric()
        self.target = random.Random(seed).randint(1, self.high)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(feedback=f"I picked a number from 1 to {self.high}. Guess it: answer with just the "
                                f"number. You have {self.max_guesses} guesses.")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.message)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.target:
            feedback = "Right!"
        elif guess is None:
            feedback = "That is not a number."
        else:
            feedback = "Higher." if guess < self.target else "Lower."
        done = guess == self.target or self._state.step_count >= self.max_guesses
        obs = GuessObservation(feedback=feedback, done=done)
        obs.reward = self._apply_rubric(action, obs)
        return obs

    @property
    def state(self) -> State:
        return self._state


def environment_reward_only(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """reward_fn of the example: nothing beyond the environment's own per-turn rewards."""
    return 0.0


if __name__ == "__main__":
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    uvicorn.run(create_app(GuessEnv, GuessAction, GuessObservation), host="127.0.0.1", port=8000)
