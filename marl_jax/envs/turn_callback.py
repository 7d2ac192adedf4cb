"""The host callback of the multi-turn rollout: an environment and a tokenizer behind
`step_turns(rows, action_token_lists)`, token ids in and token ids out.

`turn_callback(environment, tokenizer, task_rows, seeds, max_observation_tokens=...)` resets the
environment on every task row and returns each row's first prompt ids (chat template and
generation prompt) and the callback. The engine decodes each active row to the end of its turn
and calls `step_turns` with the rows it stepped and their action token ids; the callback decodes
the actions, steps the environment, and returns per row the observation span to prefill (the
token ids of `marl_jax.envs.chat_turns.observation_span`, None once done), the turn's reward and
the done / failed flags. An action the policy left open (it did not end with the end-of-turn
token, e.g. it ran out of its turn's tokens) is closed by the environment: its span starts with
that token. A span longer than `max_observation_tokens` ends its row as failed, like a broken
environment step; a failed row's turn earns 0 reward. `step_turns.episode_metrics()` is the
environment's `episode_metrics` of the episodes' states so far.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

from marl_jax.envs.base import Environment
from marl_jax.envs.chat_turns import end_of_turn_ids, observation_span, prompt_ids


class TurnStep(NamedTuple):
    """The callback's answer for n stepped rows.

    observation_ids: [n] token ids of each observation span, None where done.
    rewards: [n] float32; done: [n] bool (failed rows included); failed: [n] bool.
    """

    observation_ids: list
    rewards: np.ndarray
    done: np.ndarray
    failed: np.ndarray


def turn_callback(environment: Environment, tokenizer, task_rows: Sequence[dict],
                  seeds: Sequence, *, max_observation_tokens: int) -> tuple[list, Callable]:
    """(first prompt ids [B] lists of ints, `step_turns`) for the B task rows (see the module).

    `step_turns(rows, action_token_lists) -> TurnStep`: rows are indices into `task_rows` of the
    rows still running, action_token_lists their actions' token ids."""
    if not isinstance(max_observation_tokens, int) or max_observation_tokens < 1:
        raise ValueError(f"max_observation_tokens={max_observation_tokens!r} must be an int >= 1")
    end = end_of_turn_ids(tokenizer)[0]
    states, prompts = environment.reset(task_rows, seeds)
    conversations = [list(messages) for messages in prompts]
    first_prompt_ids = [prompt_ids(tokenizer, messages) for messages in prompts]
    finished = np.zeros(len(states), bool)

    def step_turns(rows, action_token_lists) -> TurnStep:
        rows = [int(r) for r in rows]
        tokens = [[int(t) for t in action] for action in action_token_lists]
        if len(rows) != len(tokens):
            raise ValueError(f"step_turns got {len(rows)} rows but {len(tokens)} actions")
        if len(set(rows)) != len(rows):
            raise ValueError(f"step_turns got a row twice: {rows}")
        for r in rows:
            if not 0 <= r < len(states):
                raise ValueError(f"row {r} is not one of the {len(states)} task rows")
            if finished[r]:
                raise ValueError(f"row {r} is done; step_turns steps running rows only")
        texts = [tokenizer.decode(action, skip_special_tokens=True) for action in tokens]
        result = environment.step([states[r] for r in rows], texts, tokens)
        rewards, done, failed = result.rewards.copy(), result.done.copy(), result.failed.copy()
        observation_ids = [None] * len(rows)
        for j, r in enumerate(rows):
            if not failed[j]:
                states[r] = result.states[j]
                conversations[r].append({"role": "assistant", "content": texts[j]})
            if done[j] or failed[j]:
                continue
            span = observation_span(tokenizer, conversations[r], result.observations[j],
                                    role=environment.observation_role)
            if not tokens[j] or tokens[j][-1] != end:
                span = [end] + span
            if len(span) > max_observation_tokens:
                failed[j], done[j], rewards[j] = True, True, 0.0
                continue
            conversations[r].append({"role": environment.observation_role,
                                     "content": result.observations[j]})
            observation_ids[j] = span
        finished[rows] = done
        return TurnStep(observation_ids, rewards, done, failed)

    step_turns.episode_metrics = lambda: environment.episode_metrics(states)
    return first_prompt_ids, step_turns
