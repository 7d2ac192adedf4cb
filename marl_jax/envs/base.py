"""The environment protocol of multi-turn RLHF: Gymnasium's reset / step, per row and batched on
the host.

An environment is reset from a task row (a dict) and a seed, which gives its state and the first
prompt as chat messages (`[{"role", "content"}]`), and is stepped from the policy's action (its
text and its token ids) to a new state, the observation text (None once done), the turn's reward
and whether the episode is done. States are values: `step_row` returns a new state and leaves
the old one as it was. The one exception is a library's game (`gem_env`, `textarena_env`), whose
state is the library's live object: `step_row` advances it in place and returns it. So a caller
steps each state once and branches an episode by replaying it from a fresh reset of its row and
seed, never by stepping an old state again (what the rollout's callback and the credit probe's
continuations do).

The batched `reset` / `step` run every row on the host. `step` catches each row's failure (an
exception, an observation that is not text, a reward that is not a finite number, a done flag
that is not a bool) and ends that row with its `failed` flag, so that one broken row neither
stops the run nor touches the other rows; `flag_counts` gives the step's metrics of them.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import numbers
from typing import Any, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One batched step of B rows.

    states: [B] the rows' new states (a failed row keeps its old one, which a library's game
      may have advanced: the row is done either way).
    observations: [B] the text the environment writes before the next action; None where done.
    rewards: [B] float32, each row's reward of this turn (0 where failed).
    done: [B] bool, the episode is over (failed rows included).
    failed: [B] bool, the environment broke on this row.
    """

    states: list
    observations: list
    rewards: np.ndarray
    done: np.ndarray
    failed: np.ndarray


class Environment:
    """A multi-turn text environment. Subclasses implement `reset_row` and `step_row`.

    `observation_role` is the chat role of the observations ("user" or "tool") when they are
    written into the conversation through the chat template; `row_workers` is how many rows
    `step` runs at once (threads: for environments that wait on subprocesses).
    """

    observation_role: str = "user"
    row_workers: int = 1

    def reset_row(self, row: dict, rng: np.random.Generator) -> tuple[Any, list]:
        """(state, first prompt as chat messages) of the episode of task `row`."""
        raise NotImplementedError

    def step_row(self, state, action_text: str,
                 action_tokens: Sequence[int]) -> tuple[Any, Optional[str], float, bool]:
        """(new state, observation or None, reward, done) after the policy's action."""
        raise NotImplementedError

    def episode_metrics(self, states: Sequence) -> dict:
        """The environment's own counts over the episodes whose current states are `states`
        (metric name -> float, e.g. the share of answers a checker could not read), logged with
        the training step that played them; none by default."""
        return {}

    def reset(self, rows: Sequence[dict], seeds: Sequence) -> tuple[list, list]:
        """([B] states, [B] first prompts as chat messages) of `rows`, row i drawn from
        `np.random.default_rng(seeds[i])` (an int or a numpy Generator). A row the environment
        cannot start from raises one ValueError naming the row."""
        rows, seeds = list(rows), list(seeds)
        if len(rows) != len(seeds):
            raise ValueError(f"reset got {len(rows)} rows but {len(seeds)} seeds")
        states, prompts = [], []
        for i, (row, seed) in enumerate(zip(rows, seeds)):
            try:
                state, messages = self.reset_row(row, np.random.default_rng(seed))
            except Exception as error:
                raise ValueError(f"{type(self).__name__} cannot start from task row {i}: "
                                 f"{error}") from None
            states.append(state)
            prompts.append(messages)
        return states, prompts

    def step(self, states: Sequence, action_texts: Sequence[str],
             action_token_lists: Sequence[Sequence[int]]) -> StepResult:
        """One turn of every row: `step_row` per row (on `row_workers` threads where an
        environment waits on other processes, e.g. a jail), a failing row flagged (see the
        module)."""
        states, texts, tokens = list(states), list(action_texts), list(action_token_lists)
        if not len(states) == len(texts) == len(tokens):
            raise ValueError(f"step got {len(states)} states, {len(texts)} action texts and "
                             f"{len(tokens)} action token lists; they must be as many")
        b = len(states)
        rows = range(b)
        if self.row_workers > 1 and b > 1:
            with concurrent.futures.ThreadPoolExecutor(min(self.row_workers, b)) as pool:
                outcomes = list(pool.map(self._step_checked, rows, states, texts, tokens))
        else:
            outcomes = list(map(self._step_checked, rows, states, texts, tokens))
        new_states, observations = list(states), [None] * b
        rewards = np.zeros(b, np.float32)
        done, failed = np.ones(b, bool), np.zeros(b, bool)
        for i, outcome in enumerate(outcomes):
            if outcome is None:
                failed[i] = True
                continue
            new_states[i], observation, rewards[i], done[i] = outcome
            observations[i] = None if done[i] else observation
        return StepResult(new_states, observations, rewards, done, failed)

    def _step_checked(self, i: int, state, text: str, tokens):
        """`step_row`'s answer for row i, or None where it raised or is malformed."""
        try:
            outcome = self.step_row(state, text, tokens)
        except Exception as error:
            logger.warning("%s failed on row %d: %s: %s", type(self).__name__, i,
                           type(error).__name__, error)
            return None
        if not (isinstance(outcome, tuple) and len(outcome) == 4
                and _well_formed(*outcome[1:])):
            logger.warning("%s failed on row %d: step_row returned %.200r", type(self).__name__,
                           i, outcome)
            return None
        return outcome


def _well_formed(observation, reward, done) -> bool:
    if not isinstance(done, (bool, np.bool_)):
        return False
    if not done and not isinstance(observation, str):
        return False
    return (isinstance(reward, numbers.Real) and not isinstance(reward, (bool, np.bool_))
            and math.isfinite(reward))


def flag_counts(done, failed) -> dict:
    """The step's metrics of its flags: rows done and rows failed (done and failed [B] bool)."""
    return {"env/done_rows": int(np.sum(done)), "env/failed_rows": int(np.sum(failed))}
