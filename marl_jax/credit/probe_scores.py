"""The scores of a credit probe's saved inputs (`<workdir>/credit/step_<n>.npz`, one probe's or
several runs' pooled): the states of every level (each response token, each rule's macros)
with their A* from the saved state values, and every estimator's scores against them
(`credit.estimator_scores`). The probe writes its metrics row with them; the report
(experiments/credit_report.py) pools runs and compares estimators with them.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from marl_jax.credit import estimator_scores
from marl_jax.credit import truth as credit_truth


def token_spans(response_mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, starts, ends) `[S]`: one span [t, t + 1) per valid response token."""
    lengths = credit_truth.valid_lengths(response_mask)
    rows = np.repeat(np.arange(lengths.size), lengths)
    starts = np.concatenate([np.arange(n) for n in lengths]) if lengths.sum() else np.zeros(0, int)
    return rows, starts, starts + 1


def macro_rule(name: str) -> str | None:
    """The rule whose macros an estimator's advantages are constant over, or None."""
    parts = name.split("/")
    return parts[1] if parts[0] in ("macro_gae", "macro_mc") else None


class LevelStates(NamedTuple):
    """The states one level of a probe scores (`[S]` each): the response row and first token
    of each span, its A* (`truth`), the A* of the continuations' two halves (`halves [S, 2]`)
    and the prompt it belongs to (`prompts`, the bootstrap's unit)."""

    rows: np.ndarray
    starts: np.ndarray
    truth: np.ndarray
    halves: np.ndarray
    prompts: np.ndarray


def level_states(inputs: dict, prompts_of_rows) -> dict:
    """{level: LevelStates} of one probe's (or several pooled probes') inputs (`probe_inputs`'
    arrays), `prompts_of_rows [B]` each response's prompt id. Level "token": every response
    token [t, t + 1); level "macro/<rule>": every macro of the rule's segments."""
    values = credit_truth.StateValues(
        rows=inputs["state_rows"], positions=inputs["state_positions"],
        mean=inputs["state_mean"], se=inputs["state_se"], halves=inputs["state_halves"],
        returns=None)
    index = {(int(b), int(t)): i for i, (b, t) in enumerate(zip(values.rows, values.positions))}
    rewards = inputs["rewards"]
    gamma = float(inputs["gamma"])
    mask = inputs["response_mask"]
    levels = {"token": token_spans(mask)}
    for key in inputs:
        if key.startswith("segments/"):
            levels["macro/" + key.split("/", 1)[1]] = credit_truth.segment_spans(inputs[key], mask)
    out = {}
    for level, (rows, starts, ends) in levels.items():
        start_state = np.array([index[(b, s)] for b, s in zip(rows, starts)], dtype=np.int64)
        end_state = np.array([index[(b, e)] for b, e in zip(rows, ends)], dtype=np.int64)
        span_rewards = np.array([(rewards[b, s:e] * gamma ** np.arange(e - s)).sum()
                                 for b, s, e in zip(rows, starts, ends)])
        truth, _, halves = credit_truth.span_advantages(values, start_state, end_state,
                                                        span_rewards, ends - starts, gamma)
        out[level] = LevelStates(rows=rows, starts=starts, truth=truth, halves=halves,
                                 prompts=np.asarray(prompts_of_rows)[rows])
    return out


def level_estimators(inputs: dict, level: str) -> list[str]:
    """The estimators a level scores: every one at the token level; at "macro/<rule>" those
    whose advantages are constant over that rule's macros."""
    names = [k.split("/", 1)[1] for k in inputs if k.startswith("advantages/")]
    if level == "token":
        return names
    return [name for name in names if macro_rule(name) == level.split("/", 1)[1]]


def level_advantages(inputs: dict, states: LevelStates, names) -> dict:
    """{name: advantages `[S]`} of estimators at a level's states (each span's first token)."""
    return {name: inputs["advantages/" + name][states.rows, states.starts] for name in names}


def score_probe(inputs: dict, prompts_of_rows, **bootstrap) -> dict:
    """{level: {estimator: scores}} and {level: noise ceiling} of one probe's (or several pooled
    probes') inputs (`probe_inputs`' arrays), `prompts_of_rows [B]` each response's prompt id.

    Level "token": every estimator's advantage at every response token against A*_t. Level
    "macro/<rule>": each of that rule's estimators' advantage at a macro's first token against
    the macro's A*."""
    scores, ceilings = {}, {}
    for level, states in level_states(inputs, prompts_of_rows).items():
        ceilings[level] = estimator_scores.noise_ceiling(states.halves, states.prompts, **bootstrap)
        estimates = level_advantages(inputs, states, level_estimators(inputs, level))
        scores[level] = {name: estimator_scores.score_advantages(x, states.truth, states.prompts,
                                                                 **bootstrap)
                         for name, x in estimates.items()}
    return scores, ceilings
