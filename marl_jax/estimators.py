"""Advantage estimators: one record each (`ESTIMATORS`), and the critic-free ones' functions:
group baselines, REINFORCE++, Monte Carlo macro values.

Every estimator's rules live in its `Estimator` record: its advantage function, whether the KL to
the reference is in the reward or a loss term of its own, its published loss aggregation and
policy objective (the ratio's unit, the clip ranges, dynamic sampling, overlong shaping), the
samples per prompt it needs and whether it trains a critic. The PPO step, the config check and
the experiment's arms read them here (`objective` resolves a config's fields over its record).
GSPO and DAPO are records too: GRPO's advantages under their published objectives.

Per-token advantages are float `[B, R]` over the response positions, 0 on padding; responses are
left-aligned (`response_mask[b, :L_b] == 1`). They are targets: no gradient flows through them.

Every estimator with a statistic over rows (a group's mean, standard deviation or leave-one-out
count, a batch normalisation) takes `rows`, bool `[B]`, the rows that count (None: every row):
a row out of it (a multi-turn trajectory whose environment failed, which leaves the loss) enters
no statistic, as if its group had one sample fewer, and gets advantage 0. A group left with one
valid row gets 0, as a group of identical scores does; with every row valid the advantages are
those without `rows`, to the bit.

- `sequence_advantages`: one advantage per sampled response from the rewards of the other
  samples of its prompt ("grpo", "dr_grpo", "rloo", `group_advantages`);
  `sequence_advantages_to_tokens` spreads it over the response. GRPO and Dr. GRPO normalise the
  score alone and carry the KL as a loss term (DeepSeekMath, TRL's GRPO); RLOO subtracts beta x
  the response's summed KL from its score before the leave-one-out baseline (Ahmadian et al.,
  2024; TRL's RLOO) and has no KL loss term. RLOO's advantage is theirs, its loss is not: they
  clip one ratio per response, exp(sum_t logp_t - sum_t old_logp_t), and average the
  responses; `rloo` here clips each token's own ratio and averages the tokens (`token_mean`),
  PPO's loss. On policy (ratio 1) the two gradients differ by the factor 1 / mean response
  length; under more epochs or minibatches they also clip differently.
- `reinforce_pp_advantages`: REINFORCE++, the undiscounted return-to-go of the per-token rewards,
  normalised over the batch.
- Per-turn credit for multi-turn trajectories (the action mask has holes at the observation
  spans, `turn_ids` gives each token's turn): `turn_returns`, each action token's reward-to-go
  from its turn; `turn_rloo_advantages`, that reward-to-go minus the mean of the other k - 1
  samples' reward-to-go from the same turn index, a sample that stopped earlier counting 0 (an
  unbiased gradient when the policy decides when to stop); `turn_index_normalised_advantages`,
  the per-turn-index normalisation over the samples that reached the turn (MT-GRPO style),
  biased when the policy decides when to stop (docs/objectives.md, "Per-turn credit").
- Monte Carlo macro values (VinePPO with macro actions): `choose_branch_points` picks macro
  starts to branch from, the caller samples continuations from each (`flatten_branches` lists
  them) and averages their KL-regularised returns (score - beta x the continuation's summed KL)
  into `start_values`, and `macro_mc_advantages` turns those values into advantages with no
  critic.
"""
import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.macro.advantage import _check_segment_ids, macro_gae
from marl_jax.macro.checks import (
    check_choice,
    check_mask,
    check_rank,
    check_same_shape,
    is_concrete,
)

GROUP_STD_EPS = 1e-4  # TRL's GRPO: (score - mean) / (std + 1e-4)
REINFORCE_PP_VAR_EPS = 1e-8  # OpenRLHF: (x - mean) * rsqrt(max(var, 1e-8))


class AdvantageInputs(NamedTuple):
    """What a critic-free estimator reads of one batch of B sampled responses.

    scores: float `[B]` each response's terminal reward (the clipped score minus any missing-EOS
      penalty; 0 on an empty response).
    kl: float `[B, R]` the per-token KL estimate to the reference, as the KL penalty uses it
      (0 on padding).
    kl_coef: beta, a scalar (traced under an adaptive controller).
    rewards: float `[B, R]` per-token rewards: -beta x kl on every token, plus the terminal reward
      on the last valid one (and, in a multi-turn trajectory, each turn's reward on its last
      action token).
    response_mask: `[B, R]` the policy's tokens: a left-aligned response, or a trajectory's
      action mask (holes at its observation spans).
    group_size: samples per prompt k (rows `g k .. g k + k - 1` are prompt g's), a Python int.
    branches: `(starts [B, M], valid [B, M], start_values [B, M])` of the Monte Carlo branch
      points (`choose_branch_points` and the mean returns of their continuations), or None.
    turn_ids: int `[B, R]` a multi-turn trajectory's turn of each token, or None (one turn).
    rows: bool `[B]` the rows the statistics over rows count (those whose environment did not
      fail), or None (every row).
    """

    scores: Any
    kl: Any
    kl_coef: Any
    rewards: Any
    response_mask: Any
    group_size: int = 1
    branches: Optional[tuple] = None
    turn_ids: Any = None
    rows: Any = None


@dataclasses.dataclass(frozen=True)
class Estimator:
    """One estimator's rules.

    advantages: the per-token advantages it trains on. The critic-free ones map
      `AdvantageInputs` to float `[B, R]`; "gae" is macro GAE over the critic's values
      (`macro_gae`, run per variant of the run by the step, with the returns the critic fits).
    kl_in_loss: True: the KL to the reference is a loss term of its own, beta x k3 per token,
      aggregated as the policy loss, and the advantages see the score alone; False: no KL loss
      term (the KL is in the reward where the advantage function reads it, per token or per
      sequence before a group baseline; GSPO's and DAPO's advantages see the score alone, so
      they have no KL term at all).
    loss_aggregation: the published aggregation of per-token losses (`losses.aggregate_tokens`),
      used when `config.ppo.loss_aggregation` is "auto"; RLOO's paper has no per-token loss
      (one clipped ratio per response), its record the token mean of PPO.
    min_group_size: the fewest samples per prompt (`config.ppo.group_size`) it can use.
    needs_critic: it trains a critic (and builds one).
    branches: it samples Monte Carlo continuations from macro starts every step
      (`AdvantageInputs.branches`), which score on device.
    ratio_level, ratio_form: the unit whose ratio is clipped and how its tokens' ratios combine
      (`losses.ppo_policy_loss`), used when `config.ppo.ratio_level` / `ratio_form` are "auto".
    clipranges: (low, high) published clip ranges; None: `config.ppo.cliprange` for both.
    dynamic_sampling_oversample: m > 1 samples m times the prompts a step trains on and keeps
      the groups whose rewards differ (`informative_groups`); 1: off.
    group_normalised: its advantages are each response's score relative to its group's alone
      (no KL, no statistics of other groups), so a group whose k scores are equal has zero
      advantage: the one case where dropping such a group (dynamic sampling) loses no signal.
      Under RLOO (the KL in the reward before the leave-one-out baseline), REINFORCE++ (batch
      whitening), GAE and Monte Carlo values the group still carries signal, and dropping it
      would select on the reward.
    overlong_buffer_fraction, overlong_penalty: the soft overlong punishment
      (`losses.overlong_penalty`) over the last fraction of the response budget; 0: off.
    """

    advantages: Callable
    kl_in_loss: bool
    loss_aggregation: str
    min_group_size: int = 1
    needs_critic: bool = False
    branches: bool = False
    ratio_level: str = "token"
    ratio_form: str = "product"
    clipranges: Optional[tuple] = None
    dynamic_sampling_oversample: int = 1
    group_normalised: bool = False
    overlong_buffer_fraction: float = 0.0
    overlong_penalty: float = 0.0


@dataclasses.dataclass(frozen=True)
class Objective:
    """The policy objective of a config: its `config.ppo` fields, each unset one ("auto" or
    None) taken from the estimator's record (`objective`).

    ratio_level, ratio_form: `losses.ppo_policy_loss`'s.
    cliprange_low, cliprange_high: the clip ranges 1 - low, 1 + high of the ratio.
    dual_clip: c > 1 bounds a negative advantage's loss by c |A|; None: off.
    dynamic_sampling_oversample: m (1: off).
    overlong_buffer: tokens at the end of the response budget over which the overlong penalty
      rises (0: off); overlong_penalty: its largest value.
    """

    ratio_level: str
    ratio_form: str
    cliprange_low: float
    cliprange_high: float
    dual_clip: Optional[float]
    dynamic_sampling_oversample: int
    overlong_buffer: int
    overlong_penalty: float

    @property
    def overlong_shaping(self) -> bool:
        return self.overlong_buffer > 0 and self.overlong_penalty > 0


def action_budget(config) -> int:
    """The most policy tokens a row holds, which DAPO's overlong penalty counts against:
    `ppo.response_length` for one response; on an environment's task (`ppo.reward_source=env`),
    whose trajectory budget `ppo.response_length` also holds the observations, at most
    `task.max_turns` turns of `task.max_turn_tokens` action tokens."""
    p = config.ppo
    if p.get("reward_source") != "env":
        return int(p.response_length)
    return min(int(p.response_length),
               int(config.task.max_turns) * int(config.task.max_turn_tokens))


def objective(ppo_config, budget=None) -> Objective:
    """The `Objective` of `config.ppo` (a ConfigDict or a dict): a field set in the config wins,
    an unset one ("auto", None) is the record's of `ppo_config.estimator`. The clip ranges
    default to `cliprange` where the record publishes none; the overlong buffer, a fraction of
    the response budget in the record, is rounded to tokens of `budget` (`action_budget`;
    None: `response_length`)."""
    record = ESTIMATORS[ppo_config.get("estimator", "gae")]
    unset = lambda field: ppo_config.get(field, None) in (None, "auto")  # noqa: E731
    value = lambda field, default: default if unset(field) else ppo_config[field]  # noqa: E731
    low, high = record.clipranges or (ppo_config["cliprange"],) * 2
    budget = int(ppo_config["response_length"] if budget is None else budget)
    buffer = int(round(record.overlong_buffer_fraction * budget))
    return Objective(
        ratio_level=value("ratio_level", record.ratio_level),
        ratio_form=value("ratio_form", record.ratio_form),
        cliprange_low=float(value("cliprange_low", low)),
        cliprange_high=float(value("cliprange_high", high)),
        dual_clip=None if unset("dual_clip") else float(ppo_config["dual_clip"]),
        dynamic_sampling_oversample=int(value("dynamic_sampling_oversample",
                                              record.dynamic_sampling_oversample)),
        overlong_buffer=int(value("overlong_buffer", buffer)),
        overlong_penalty=float(value("overlong_penalty", record.overlong_penalty)))


def sequence_advantages(scores, kl_sums, *, method, group_size, beta, rows=None):
    """The advantage each response of a group method trains on, one per response.

    "rloo" puts the KL in the reward: each response's reward is score - beta x its summed KL,
    and its advantage that reward minus the mean reward of the other k - 1 samples of its prompt
    (Ahmadian et al., 2024; TRL's RLOOTrainer). "grpo" and "dr_grpo" normalise the score alone
    (`kl_sums` and `beta` unused): their KL is a loss term (`Estimator.kl_in_loss`). See
    `group_advantages` for the baselines.

    Args:
      scores: float `[B]` terminal rewards (clipped score, missing-EOS penalty).
      kl_sums: float `[B]` each response's summed per-token KL estimate to the reference, as the
        KL penalty uses it.
      method: one of `GROUP_METHODS`; static under `jax.jit`.
      group_size: samples per prompt k >= 2 dividing B; static under `jax.jit`.
      beta: the KL coefficient (a float or a traced scalar).
      rows: bool `[B]` the rows that count (see the module), or None (every row).

    Returns:
      float `[B]` advantages.
    """
    check_choice(method, GROUP_METHODS, "method")
    check_rank(scores, 1, "scores")
    check_rank(kl_sums, 1, "kl_sums")
    check_same_shape(scores, "scores", kl_sums=kl_sums)
    if not ESTIMATORS[method].kl_in_loss:
        scores = jnp.asarray(scores, _float_dtype(scores, kl_sums)) - beta * jnp.asarray(kl_sums)
    return group_advantages(scores, group_size, method=method, rows=rows)


def group_advantages(scores, group_size, *, method, rows=None):
    """Advantages of sampled responses relative to the other samples of the same prompt.

    Rows `g * k .. g * k + k - 1` (k = `group_size`) are the k samples of prompt g. With m and s
    the group's mean and unbiased standard deviation (ddof = 1):

    - "grpo":    (score - m) / (s + 1e-4), as TRL's GRPO;
    - "dr_grpo": score - m (Dr. GRPO: no division by the standard deviation);
    - "rloo":    score - the mean of the group's OTHER k - 1 scores, i.e. k / (k - 1) (score - m).

    A group of identical scores gets zeros exactly (the group is centred on its first score
    before anything is summed), never NaN.

    With `rows`, k, m and s are those of the group's valid rows alone (a group of one valid row
    gets 0, as a group of identical scores), and a row out of `rows` gets 0.

    Args:
      scores: float `[B]`, one score per response; numpy or jax.
      group_size: samples per prompt k, a Python int >= 2 dividing B (one sample is its own
        baseline: every advantage would be 0); static under `jax.jit`.
      method: one of `GROUP_METHODS`; static under `jax.jit`.
      rows: bool `[B]` the rows that count (see the module), or None (every row).

    Returns:
      float `[B]` advantages.
    """
    check_choice(method, GROUP_METHODS, "method")
    check_rank(scores, 1, "scores")
    group_size = _static_int(group_size, "group_size", ESTIMATORS[method].min_group_size,
                             f" for method {method!r}")
    if np.shape(scores)[0] % group_size:
        raise ValueError(f"group_size={group_size} must divide the number of scores "
                         f"{np.shape(scores)[0]}")
    _check_rows(rows, np.shape(scores)[0])
    return _group_advantages(scores, rows, group_size=group_size, method=method)


def informative_groups(scores, group_size, keep):
    """Dynamic sampling (DAPO, Yu et al., 2025): the first `keep` groups whose scores are not
    all equal, as a fixed number of rows.

    Rows `g * k .. g * k + k - 1` (k = `group_size`) are the k samples of prompt g. A group of
    equal scores has zero advantages under a group baseline: it carries no signal. The kept
    groups are the informative ones in their order, then, when fewer than `keep` are, the
    first uninformative ones in theirs, which `trained` marks False (a shortfall the loss
    leaves out).

    Args:
      scores: float `[G * k]`, one score per response.
      group_size: samples per prompt k >= 2, a Python int.
      keep: groups kept, a Python int in [1, G].

    Returns:
      `(rows, trained, informative)`: int32 `[keep * k]` the kept groups' rows in order; bool
      `[keep * k]` True on the rows of informative groups; int32 the number of informative
      groups among all G.
    """
    check_rank(scores, 1, "scores")
    group_size = _static_int(group_size, "group_size", 2)
    if np.shape(scores)[0] % group_size:
        raise ValueError(f"group_size={group_size} must divide the number of scores "
                         f"{np.shape(scores)[0]}")
    groups = np.shape(scores)[0] // group_size
    keep = _static_int(keep, "keep", 1)
    if keep > groups:
        raise ValueError(f"keep={keep} exceeds the {groups} groups of the scores")
    return _informative_groups(scores, group_size=group_size, keep=keep)


def sequence_advantages_to_tokens(advantages, response_mask):
    """Every valid token of row b gets the row's advantage: float `[B, R]`, 0 on padding.

    Args:
      advantages: float `[B]`.
      response_mask: `[B, R]` 0/1 (or bool) response mask.
    """
    check_rank(advantages, 1, "advantages")
    check_mask(response_mask, "response_mask", left_aligned=False)
    if np.shape(advantages)[0] != np.shape(response_mask)[0]:
        raise ValueError(f"advantages has shape {np.shape(advantages)} but response_mask has "
                         f"{np.shape(response_mask)[0]} rows")
    return _sequence_advantages_to_tokens(advantages, response_mask)


def reinforce_pp_advantages(rewards, response_mask, rows=None):
    """REINFORCE++ (Hu, 2025; OpenRLHF's `reinforce_plus_plus` estimator).

    A_t = sum_{i >= t} r_i, the undiscounted return-to-go of the per-token rewards, then
    normalised over all valid tokens of the batch: (A - mean) * rsqrt(max(var, 1e-8)), with the
    mean and the (biased, ddof = 0) variance over the valid tokens, as OpenRLHF does.

    Args:
      rewards: float `[B, R]` per-token rewards as PPO assembles them: the KL penalty of every
        token, plus the score on the last valid token.
      response_mask: `[B, R]` 0/1 mask of the action tokens (left-aligned for one response; a
        multi-turn trajectory's observation spans are holes, whose rewards are left out).
      rows: bool `[B]` the rows whose tokens the mean and variance count (see the module), or
        None (every row).

    Returns:
      float `[B, R]` advantages, 0 on padding and on the rows out of `rows` (all 0 when no token
      is valid).
    """
    check_rank(rewards, 2, "rewards")
    check_mask(response_mask, "response_mask", left_aligned=False)
    check_same_shape(rewards, "rewards", response_mask=response_mask)
    _check_rows(rows, np.shape(response_mask)[0])
    return _reinforce_pp_advantages(rewards, response_mask, rows)


def turn_returns(turn_rewards, action_mask, turn_ids):
    """Each action token's reward-to-go from its turn: the sum of the rewards of its turn and of
    every later turn of its row.

    Args:
      turn_rewards: float `[B, T]` rewards on the action tokens: each turn's reward on its last
        action token (an environment's per-turn reward, the final score on the last turn's);
        a reward on any other action token (a per-token KL penalty) counts toward its turn;
        rewards off the action tokens are ignored.
      action_mask: `[B, T]` 0/1 mask of the policy's tokens; observation spans are holes.
      turn_ids: int `[B, T]` turn index of each token, in [0, T) and non-decreasing along a row
        (an observation span carries the turn it follows, padding the row's last turn).

    Returns:
      float `[B, T]` reward-to-go, 0 off the action tokens.
    """
    _check_turns(turn_rewards, action_mask, turn_ids)
    return _turn_returns(turn_rewards, action_mask, turn_ids)


def turn_rloo_advantages(turn_rewards, action_mask, turn_ids, group_size, rows=None):
    """Per-turn leave-one-out advantages, unbiased when the policy decides when to stop.

    Rows `g k .. g k + k - 1` (k = `group_size`) are the k samples of prompt g. With G_t^j the
    reward-to-go of sample j from its turn t (`turn_returns`), and G_t^j = 0 when sample j
    stopped before turn t (it earns nothing from turn t on), every action token of turn t of
    sample i gets

        A_t^i = G_t^i - b_t^i,    b_t^i = 1 / (k - 1) sum_{j != i} G_t^j,

    a baseline of k - 1 terms whatever the samples' lengths. Why the policy gradient
    sum_i sum_t A_t^i grad log pi(a_t^i | s_t^i) is unbiased: the reward-to-go term is
    REINFORCE's (an action does not change the rewards before it); b_t^i is a function of the
    other samples only, which are drawn independently of sample i, so
    E[b_t^i 1{i reached t} grad log pi(a_t^i | s_t^i)] = E[b_t^i] E[1{i reached t}
    E[grad log pi(a_t^i | s_t^i) | s_t^i]] = 0, the inner expectation of a score function being
    0. Its expectation is the true gradient exactly, with no scale factor. A baseline over the
    samples that reached turn t (`turn_index_normalised_advantages`) has neither property: it
    contains G_t^i itself, with a weight 1 / n_t set by how many samples reached t.

    With one turn and the score on the last action token this is RLOO's advantage of the score
    (`group_advantages(..., method="rloo")`) on every action token.

    With `rows`, j and k run over the group's valid rows alone (n of them: a baseline of n - 1
    terms; 0 when n = 1), and a row out of `rows` gets 0.

    Args:
      turn_rewards, action_mask, turn_ids: as in `turn_returns`.
      group_size: samples per prompt k, a Python int >= 2 dividing B; static under `jax.jit`.
      rows: bool `[B]` the rows that count (see the module), or None (every row).

    Returns:
      float `[B, T]` advantages, each turn's on its action tokens, 0 elsewhere.
    """
    _check_turns(turn_rewards, action_mask, turn_ids)
    group_size = _turn_group_size(group_size, action_mask)
    _check_rows(rows, np.shape(action_mask)[0])
    return _turn_rloo_advantages(turn_rewards, action_mask, turn_ids, rows,
                                 group_size=group_size)


def turn_index_normalised_advantages(turn_rewards, action_mask, turn_ids, group_size, *,
                                     divide_by_std=True, rows=None):
    """The per-turn-index normalisation (MT-GRPO style): at turn index t, each sample's
    reward-to-go normalised over the samples of its prompt that reached turn t, itself included.

    With R_t the samples j of the group that have an action token in turn t, n_t = |R_t|, m_t
    and s_t the mean and unbiased standard deviation (ddof = 1) of their G_t^j
    (`turn_returns`), every action token of turn t of sample i gets

        A_t^i = (G_t^i - m_t) / (s_t + 1e-4),    0 when n_t = 1,

    GRPO's normalisation turn by turn (`divide_by_std=False`: G_t^i - m_t, Dr. GRPO's form).
    Kept as the record to compare with. m_t contains G_t^i, so even without the division turn
    t's expected gradient is the true one times c_t = E[1 - 1 / n_t | i reached t], and n_t
    counts the other samples that reached t: when the policy decides when to stop, c_t falls
    with t and moves with the policy, and the expected gradient leaves the true one's direction
    (the division by s_t, which depends on G_t^i too, adds to that); `turn_rloo_advantages` is
    unbiased.

    Args:
      turn_rewards, action_mask, turn_ids: as in `turn_returns`.
      group_size: samples per prompt k, a Python int >= 2 dividing B; static under `jax.jit`.
      divide_by_std: divide by s_t + 1e-4 (MT-GRPO's normalisation); False: the centred
        returns alone. Static under `jax.jit`.
      rows: bool `[B]` the rows that count (see the module): R_t holds the valid rows alone; or
        None (every row).

    Returns:
      float `[B, T]` advantages, each turn's on its action tokens, 0 elsewhere.
    """
    _check_turns(turn_rewards, action_mask, turn_ids)
    group_size = _turn_group_size(group_size, action_mask)
    _check_rows(rows, np.shape(action_mask)[0])
    return _turn_index_normalised_advantages(turn_rewards, action_mask, turn_ids, rows,
                                             group_size=group_size,
                                             divide_by_std=bool(divide_by_std))


def choose_branch_points(key, segment_ids, response_mask, max_points):
    """Response positions to branch Monte Carlo rollouts from: where macros start.

    A macro starts at position 0 of a non-empty row and wherever the segment id changes. A row
    with at most M macro starts gets all of them; a row with more keeps position 0 and M - 1 of
    the others, drawn uniformly at random without replacement (independently per row).

    Args:
      key: a `jax.random` key; unused (and may be None) when `max_points` is 0.
      segment_ids: int `[B, R]` macro index of each token (see `marl_jax.macro.termination`).
      response_mask: `[B, R]` left-aligned response mask.
      max_points: M, a Python int >= 0: branch points per row; 0 means every macro start, with
        M = R.

    Returns:
      `(starts, valid)`: int32 `[B, M]` chosen positions in ascending order, then unused slots
      (start 0); bool `[B, M]`, True on the used slots.
    """
    check_rank(segment_ids, 2, "segment_ids")
    check_mask(response_mask, "response_mask", left_aligned=True)
    check_same_shape(response_mask, "response_mask", segment_ids=segment_ids)
    _check_segment_ids(segment_ids, response_mask)
    max_points = _static_int(max_points, "max_points", 0)
    if max_points == 0:
        key = jax.random.key(0)  # every start is kept: nothing is drawn
    elif key is None:
        raise ValueError("key is required when max_points > 0")
    return _choose_branch_points(key, segment_ids, response_mask, max_points=max_points)


def flatten_branches(starts, valid):
    """The (row, prefix) pairs of `choose_branch_points`, flattened row-major for sampling.

    Pair i continues response row `row_index[i]` from the state after its first
    `prefix_lengths[i]` response tokens (0: from the prompt alone). The mean scores of the
    continuations, in the same order and reshaped to `[B, M]`, are `macro_mc_advantages`'s
    `start_values` (any value on the unused pairs).

    Args:
      starts: int `[B, M]` branch positions.
      valid: bool `[B, M]` used slots.

    Returns:
      `(row_index, prefix_lengths, flat_valid)`: int32 `[B * M]`, int32 `[B * M]`,
      bool `[B * M]`.
    """
    check_rank(starts, 2, "starts")
    check_same_shape(starts, "starts", valid=valid)
    batch, points = np.shape(starts)
    row_index = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), points)
    prefix_lengths = jnp.asarray(starts, jnp.int32).reshape(-1)
    return row_index, prefix_lengths, (jnp.asarray(valid) != 0).reshape(-1)


def macro_mc_advantages(starts, valid, start_values, scores, kl_rewards, response_mask):
    """Advantages from Monte Carlo values of the states where branch points start.

    The used branch points 0 = s_1 < s_2 < ... < s_n of a row cut its response into spans
    [s_j, s_{j+1}), the last ending at the row's length L. V(s_j) = `start_values[:, j]`, the
    mean KL-regularised return (score - beta x summed KL of the continuation) of continuations
    sampled from the state after s_j response tokens, and
    V(L) = `scores`, the observed score of the response. Every token of span j gets

        A_j = V(s_{j+1}) - V(s_j) + sum of `kl_rewards` over the span.

    With every macro start as a branch point (`max_points=0`) this is one advantage per macro;
    with fewer, the macros between two branch points share one. With `kl_rewards` = 0 the
    advantages of the spans telescope: their sum is score - V(0); with the KL, it is the
    response's KL-regularised return - V(0).

    Args:
      starts: int `[B, M]` branch positions (`choose_branch_points`); the used ones of a
        non-empty row must be distinct positions in [0, L), including 0; an empty row has none.
        Order does not matter.
      valid: bool `[B, M]` used slots.
      start_values: float `[B, M]` V(s_j) of each slot (ignored on unused slots).
      scores: float `[B]` the responses' scores.
      kl_rewards: float `[B, R]` per-token KL rewards (-beta * KL), without the score.
      response_mask: `[B, R]` left-aligned response mask.

    Returns:
      float `[B, R]` advantages, 0 on padding.
    """
    check_rank(starts, 2, "starts")
    check_same_shape(starts, "starts", valid=valid, start_values=start_values)
    check_rank(kl_rewards, 2, "kl_rewards")
    check_mask(response_mask, "response_mask", left_aligned=True)
    check_same_shape(response_mask, "response_mask", kl_rewards=kl_rewards)
    check_rank(scores, 1, "scores")
    batch = np.shape(response_mask)[0]
    for name, x in (("starts", starts), ("scores", scores)):
        if np.shape(x)[0] != batch:
            raise ValueError(f"{name} has shape {np.shape(x)} but response_mask has {batch} rows")
    _check_starts(starts, valid, response_mask)
    return _macro_mc_advantages(starts, valid, start_values, scores, kl_rewards, response_mask)


def _static_int(value, name, minimum, context=""):
    """`value` as a Python int >= `minimum`; it sets shapes, so it cannot be traced."""
    if not is_concrete(value) or np.ndim(value) != 0 or not np.issubdtype(
            np.asarray(value).dtype, np.integer):
        raise ValueError(f"{name} must be a Python int (static), got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}{context}, got {int(value)}")
    return int(value)


def _float_dtype(*arrays):
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def _check_rows(rows, batch):
    """`rows` is None or a `[batch]` mask of booleans (or 0/1)."""
    if rows is None:
        return
    check_rank(rows, 1, "rows")
    if np.shape(rows)[0] != batch:
        raise ValueError(f"rows has shape {np.shape(rows)} but the batch has {batch} rows")
    if is_concrete(rows) and not np.all(np.isin(np.asarray(rows), (0, 1))):
        raise ValueError("rows must be a boolean (or 0/1) mask")


def _valid_deviation(groups, valid):
    """Each valid sample's deviation from the mean of its group's valid samples, 0 on the
    others, and how many are valid: groups float `[G, k, ...]` (a group along axis 1), valid
    bool broadcast to them; (`[G, k, ...]`, float `[G, 1, ...]`)."""
    valid = jnp.broadcast_to(valid, groups.shape)
    count = jnp.sum(valid, axis=1, keepdims=True).astype(groups.dtype)
    # Centred on the first valid sample (the first sample when every one is valid), so that
    # equal values give exact zeros.
    first = jnp.argmax(valid, axis=1, keepdims=True)
    centred = jnp.where(valid, groups - jnp.take_along_axis(groups, first, axis=1), 0)
    mean = jnp.sum(centred, axis=1, keepdims=True) / jnp.maximum(count, 1)
    return jnp.where(valid, centred - mean, 0), count


def _others(count):
    """The other samples of a sample's group of `count` (the group size, a Python int, or the
    valid samples, float `[G, 1, ...]`), at least 1: a lone valid sample's deviation is 0."""
    return count - 1 if isinstance(count, int) else jnp.maximum(count - 1, 1)


@functools.partial(jax.jit, static_argnames=("group_size", "method"))
def _group_advantages(scores, rows, *, group_size, method):
    scores = jax.lax.stop_gradient(jnp.asarray(scores, _float_dtype(scores)))
    groups = scores.reshape(-1, group_size)

    def normalised(deviation, count):
        if method == "dr_grpo":
            return deviation
        if method == "rloo":
            return deviation * (count / _others(count))
        std = jnp.sqrt(jnp.sum(deviation * deviation, axis=1, keepdims=True) / _others(count))
        return deviation / (std + GROUP_STD_EPS)

    valid = None if rows is None else jnp.asarray(rows).reshape(groups.shape) != 0
    return _over_valid_rows(groups, valid, normalised).reshape(-1)


def _over_valid_rows(groups, valid, normalised):
    """`normalised(deviation, count)` of each group (axis 1 of `groups` `[G, k, ...]`): of every
    sample (count the Python int k) where `valid` is None or the group's samples are all valid,
    else of its valid samples (count float `[G, 1, ...]`), 0 on the others. A fully valid group
    takes the first branch, so its advantages are those without `valid` to the bit."""
    # Centred on the first sample: identical values become exact zeros, so their mean and
    # standard deviation are exactly 0 too.
    centred = groups - groups[:, :1]
    every = normalised(centred - jnp.mean(centred, axis=1, keepdims=True), groups.shape[1])
    if valid is None:
        return every
    valid = jnp.broadcast_to(valid, groups.shape)
    some = normalised(*_valid_deviation(groups, valid))
    return jnp.where(jnp.all(valid, axis=1, keepdims=True), every, jnp.where(valid, some, 0))


@functools.partial(jax.jit, static_argnames=("group_size", "keep"))
def _informative_groups(scores, *, group_size, keep):
    groups = jnp.asarray(scores).reshape(-1, group_size)
    informative = jnp.any(groups != groups[:, :1], axis=1)
    # A stable sort on "uninformative" puts the informative groups first, each part in order.
    order = jnp.argsort(~informative, stable=True)[:keep]
    rows = (order[:, None] * group_size + jnp.arange(group_size)).reshape(-1)
    trained = jnp.repeat(informative[order], group_size)
    return rows.astype(jnp.int32), trained, informative.sum().astype(jnp.int32)


@jax.jit
def _sequence_advantages_to_tokens(advantages, response_mask):
    advantages = jax.lax.stop_gradient(jnp.asarray(advantages, _float_dtype(advantages)))
    return jnp.where(jnp.asarray(response_mask) != 0, advantages[:, None], 0)


@jax.jit
def _reinforce_pp_advantages(rewards, response_mask, rows):
    valid = jnp.asarray(response_mask) != 0
    if rows is not None:
        valid = valid & (jnp.asarray(rows)[:, None] != 0)
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, _float_dtype(rewards)))
    rewards = jnp.where(valid, rewards, 0)
    returns = jnp.flip(jnp.cumsum(jnp.flip(rewards, axis=1), axis=1), axis=1)
    count = jnp.maximum(jnp.sum(valid), 1).astype(returns.dtype)
    mean = jnp.sum(jnp.where(valid, returns, 0)) / count
    centred = jnp.where(valid, returns - mean, 0)
    variance = jnp.sum(centred * centred) / count
    return centred * jax.lax.rsqrt(jnp.maximum(variance, REINFORCE_PP_VAR_EPS))


def _check_turns(turn_rewards, action_mask, turn_ids):
    check_rank(turn_rewards, 2, "turn_rewards")
    check_mask(action_mask, "action_mask", left_aligned=False)
    check_same_shape(action_mask, "action_mask", turn_rewards=turn_rewards, turn_ids=turn_ids)
    dtype = turn_ids.dtype if hasattr(turn_ids, "dtype") else np.asarray(turn_ids).dtype
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"turn_ids must be integers, got dtype {dtype}")
    if not is_concrete(turn_ids):
        return
    ids = np.asarray(turn_ids)
    if np.any(np.diff(ids, axis=1) < 0):
        raise ValueError("turn_ids must be non-decreasing along each row")
    if ids.size and (ids.min() < 0 or ids.max() >= ids.shape[1]):
        raise ValueError(f"turn_ids must lie in [0, {ids.shape[1]}) (one turn index per token "
                         f"at most), got values in [{ids.min()}, {ids.max()}]")


def _turn_group_size(group_size, action_mask):
    group_size = _static_int(group_size, "group_size", 2,
                             " (a sample's baseline comes from the other samples of its prompt)")
    if np.shape(action_mask)[0] % group_size:
        raise ValueError(f"group_size={group_size} must divide the number of rows "
                         f"{np.shape(action_mask)[0]}")
    return group_size


def _turn_table(turn_rewards, action_mask, turn_ids):
    """Per turn index t in [0, T): each row's reward-to-go from turn t (0 past its last turn),
    float `[B, T]`, and whether the row has an action token in turn t, bool `[B, T]`."""
    valid = jnp.asarray(action_mask) != 0
    rewards = jax.lax.stop_gradient(jnp.asarray(turn_rewards, _float_dtype(turn_rewards)))
    rewards = jnp.where(valid, rewards, 0)
    width = valid.shape[1]
    ids = jnp.clip(jnp.asarray(turn_ids, jnp.int32), 0, width - 1)
    # Turn ids rise along a row, so the tokens of turns >= t are a suffix of it, starting at the
    # first position whose id is >= t; suffix sums read there are the sums over turns >= t.
    turn_index = jnp.arange(width + 1, dtype=jnp.int32)
    first = jax.vmap(lambda row: jnp.searchsorted(row, turn_index, side="left"))(ids)

    def from_turn(x):
        """Sum of `x` `[B, T]` over the tokens of turns >= t, `[B, T + 1]` (t = 0..T)."""
        suffix = jnp.flip(jnp.cumsum(jnp.flip(x, axis=1), axis=1), axis=1)
        suffix = jnp.concatenate([suffix, jnp.zeros_like(suffix[:, :1])], axis=1)
        return jnp.take_along_axis(suffix, first, axis=1)

    actions = from_turn(valid.astype(jnp.int32))
    return from_turn(rewards)[:, :width], actions[:, :width] > actions[:, 1:]


def _per_token(per_turn, action_mask, turn_ids):
    """Spread a per-turn-index quantity `[B, T]` over each turn's action tokens."""
    width = per_turn.shape[1]
    ids = jnp.clip(jnp.asarray(turn_ids, jnp.int32), 0, width - 1)
    return jnp.where(jnp.asarray(action_mask) != 0,
                     jnp.take_along_axis(per_turn, ids, axis=1), 0)


@jax.jit
def _turn_returns(turn_rewards, action_mask, turn_ids):
    to_go, _ = _turn_table(turn_rewards, action_mask, turn_ids)
    return _per_token(to_go, action_mask, turn_ids)


@functools.partial(jax.jit, static_argnames="group_size")
def _turn_rloo_advantages(turn_rewards, action_mask, turn_ids, rows, *, group_size):
    to_go, _ = _turn_table(turn_rewards, action_mask, turn_ids)
    groups = to_go.reshape(-1, group_size, to_go.shape[1])
    # As `_group_advantages`' rloo: G - mean of the others = k / (k - 1) (G - mean of all).
    valid = None if rows is None else jnp.asarray(rows).reshape(-1, group_size, 1) != 0
    advantages = _over_valid_rows(groups, valid, lambda deviation, count: deviation * (
        count / _others(count))).reshape(to_go.shape)
    return _per_token(advantages, action_mask, turn_ids)


@functools.partial(jax.jit, static_argnames=("group_size", "divide_by_std"))
def _turn_index_normalised_advantages(turn_rewards, action_mask, turn_ids, rows, *, group_size,
                                      divide_by_std):
    to_go, reached = _turn_table(turn_rewards, action_mask, turn_ids)
    groups = to_go.reshape(-1, group_size, to_go.shape[1])
    reached = reached.reshape(groups.shape)
    if rows is not None:
        reached = reached & (jnp.asarray(rows).reshape(-1, group_size, 1) != 0)
    count = jnp.sum(reached, axis=1, keepdims=True).astype(groups.dtype)
    # Centred on one reached sample's return, so that equal returns give exact zeros.
    reference = jnp.max(jnp.where(reached, groups, -jnp.inf), axis=1, keepdims=True)
    centred = jnp.where(reached, groups - jnp.where(count > 0, reference, 0), 0)
    mean = jnp.sum(centred, axis=1, keepdims=True) / jnp.maximum(count, 1)
    deviation = jnp.where(reached, centred - mean, 0)
    if divide_by_std:
        std = jnp.sqrt(jnp.sum(deviation * deviation, axis=1, keepdims=True)
                       / jnp.maximum(count - 1, 1))
        deviation = deviation / (std + GROUP_STD_EPS)
    advantages = deviation.reshape(to_go.shape)
    return _per_token(advantages, action_mask, turn_ids)


@functools.partial(jax.jit, static_argnames="max_points")
def _choose_branch_points(key, segment_ids, response_mask, *, max_points):
    valid = jnp.asarray(response_mask) != 0
    batch, width = valid.shape
    points = max_points or width
    ids = jnp.asarray(segment_ids)
    previous = jnp.concatenate([jnp.full_like(ids[:, :1], -1), ids[:, :-1]], axis=1)
    is_start = valid & ((jnp.arange(width) == 0) | (ids != previous))
    # A random priority per start, position 0 above all of them, non-starts below: the top
    # `points` priorities are position 0 and a uniform sample of the other starts.
    priority = jax.random.uniform(key, (batch, width))
    priority = jnp.where(jnp.arange(width) == 0, 2.0, priority)
    priority = jnp.where(is_start, priority, -1.0)
    top, positions = jax.lax.top_k(priority, min(points, width))
    chosen = jnp.sort(jnp.where(top >= 0, positions, width), axis=1).astype(jnp.int32)
    if points > width:
        chosen = jnp.pad(chosen, ((0, 0), (0, points - width)), constant_values=width)
    used = chosen < width
    return jnp.where(used, chosen, 0), used


@jax.jit
def _macro_mc_advantages(starts, valid, start_values, scores, kl_rewards, response_mask):
    dtype = _float_dtype(start_values, scores, kl_rewards)
    tokens = jnp.asarray(response_mask) != 0
    batch, width = tokens.shape
    points = starts.shape[1]
    used = jnp.asarray(valid) != 0
    start_values = jax.lax.stop_gradient(jnp.asarray(start_values, dtype))
    scores = jax.lax.stop_gradient(jnp.asarray(scores, dtype))
    kl_rewards = jax.lax.stop_gradient(jnp.asarray(kl_rewards, dtype))
    # Used starts in ascending order, unused slots (position `width`) after them: span j is
    # then slot j, and the value after it is slot j + 1's, or the score after the last span.
    position = jnp.where(used, jnp.asarray(starts, jnp.int32), width)
    order = jnp.argsort(position, axis=1)
    position = jnp.take_along_axis(position, order, axis=1)
    values = jnp.take_along_axis(start_values, order, axis=1)
    num_spans = jnp.sum(used, axis=1)
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    next_values = jnp.where(jnp.arange(points) == num_spans[:, None] - 1, scores[:, None],
                            next_values)
    rows = jnp.arange(batch)[:, None]
    begins = jnp.zeros((batch, width), bool).at[rows, position].set(True, mode="drop")
    span = jnp.clip(jnp.cumsum(begins, axis=1) - 1, 0, points - 1)
    slots = (rows * points + span).reshape(-1)
    kl_sums = jax.ops.segment_sum(jnp.where(tokens, kl_rewards, 0).reshape(-1), slots,
                                  num_segments=batch * points).reshape(batch, points)
    per_span = next_values - values + kl_sums
    return jnp.where(tokens, jnp.take_along_axis(per_span, span, axis=1), 0)


def _check_starts(starts, valid, response_mask):
    dtype = starts.dtype if hasattr(starts, "dtype") else np.asarray(starts).dtype
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"starts must be integers, got dtype {dtype}")
    # Host arrays are checked; device arrays (typically straight from `choose_branch_points`)
    # are not, since reading them back would stall the dispatch.
    if any(isinstance(x, jax.Array) or not is_concrete(x)
           for x in (starts, valid, response_mask)):
        return
    used = np.asarray(valid)
    if not np.all((used == 0) | (used == 1)):
        raise ValueError("valid must be a boolean (or 0/1) mask")
    used = used != 0
    starts = np.asarray(starts).astype(np.int64)
    lengths = np.sum(np.asarray(response_mask) != 0, axis=1)[:, None]
    out_of_range = used & ((starts < 0) | (starts >= lengths))
    # Unused slots get distinct negative keys, so a repeated key is a repeated used start.
    keys = np.sort(np.where(used, starts, -1 - np.arange(starts.shape[1])), axis=1)
    repeated = np.any(np.diff(keys, axis=1) == 0, axis=1)
    no_zero = (lengths[:, 0] > 0) & ~np.any(used & (starts == 0), axis=1)
    bad = np.nonzero(np.any(out_of_range, axis=1) | repeated | no_zero)[0]
    if bad.size:
        raise ValueError(
            f"starts: the used starts of each row must be distinct positions in [0, L) that "
            f"include 0 on a non-empty row; rows {bad.tolist()} break this")


# ---- the records ------------------------------------------------------------------------------
def _turn_estimator(method):
    """A per-turn record's advantage function: the per-token rewards (the KL penalty on each
    action token, each turn's reward on its last action token, the score on the last one) summed
    per turn, and a turn's advantage on its action tokens; a single response is one turn."""
    def advantages(inputs: AdvantageInputs):
        mask = jnp.asarray(inputs.response_mask)
        turn_ids = (jnp.zeros(mask.shape, jnp.int32) if inputs.turn_ids is None
                    else inputs.turn_ids)
        if method == "turn_rloo":
            return _turn_rloo_advantages(inputs.rewards, mask, turn_ids, inputs.rows,
                                         group_size=inputs.group_size)
        return _turn_index_normalised_advantages(inputs.rewards, mask, turn_ids, inputs.rows,
                                                 group_size=inputs.group_size,
                                                 divide_by_std=True)
    return advantages


def _group_estimator(method):
    def advantages(inputs: AdvantageInputs):
        mask = inputs.response_mask
        kl_sums = jnp.where(jnp.asarray(mask) != 0, inputs.kl, 0).sum(axis=1)
        seq = sequence_advantages(inputs.scores, kl_sums, method=method,
                                  group_size=inputs.group_size, beta=inputs.kl_coef,
                                  rows=inputs.rows)
        return sequence_advantages_to_tokens(seq, mask)
    return advantages


def _reinforce_pp(inputs: AdvantageInputs):
    return reinforce_pp_advantages(inputs.rewards, inputs.response_mask, inputs.rows)


def _macro_mc(inputs: AdvantageInputs):
    starts, valid, start_values = inputs.branches
    kl_rewards = jnp.where(jnp.asarray(inputs.response_mask) != 0,
                           -inputs.kl_coef * inputs.kl, 0.0)
    return macro_mc_advantages(starts, valid, start_values, inputs.scores, kl_rewards,
                               inputs.response_mask)


# Every `config.ppo.estimator`: macro GAE with a critic, then the critic-free ones. Published
# aggregations: PPO and REINFORCE++ average tokens; GRPO averages each sequence's tokens, then
# the sequences; Dr. GRPO sums tokens over a constant. RLOO's published loss (Ahmadian et al.;
# TRL) clips one ratio per response and averages the responses, a ratio level the token-ratio
# loss cannot express: its record's token mean of token ratios is PPO's loss, not RLOO's.
ESTIMATORS = {
    "gae": Estimator(macro_gae, kl_in_loss=False, loss_aggregation="token_mean",
                     needs_critic=True),
    "grpo": Estimator(_group_estimator("grpo"), kl_in_loss=True,
                      loss_aggregation="sequence_mean", min_group_size=2, group_normalised=True),
    "dr_grpo": Estimator(_group_estimator("dr_grpo"), kl_in_loss=True,
                         loss_aggregation="token_sum", min_group_size=2, group_normalised=True),
    "rloo": Estimator(_group_estimator("rloo"), kl_in_loss=False, loss_aggregation="token_mean",
                      min_group_size=2),
    "reinforce_pp": Estimator(_reinforce_pp, kl_in_loss=False, loss_aggregation="token_mean"),
    "macro_mc": Estimator(_macro_mc, kl_in_loss=False, loss_aggregation="token_mean",
                          branches=True),
}
# The group methods: one advantage per response from the other samples of its prompt, so at
# least two samples per prompt.
GROUP_METHODS = tuple(name for name, e in ESTIMATORS.items() if e.min_group_size > 1)
# Published recipes on GRPO's advantages (the score alone, normalised in its group; no KL term):
ESTIMATORS.update(
    # GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization", arXiv 2507.18071): one
    # length-normalised ratio per response, exp(mean_t log r_t), clipped to [1 - 3e-4, 1 + 4e-4]
    # (section 5.1), the mean over responses, the KL coefficient 0.
    gspo=Estimator(_group_estimator("grpo"), kl_in_loss=False, loss_aggregation="sequence_mean",
                   min_group_size=2, group_normalised=True, ratio_level="sequence",
                   ratio_form="geometric", clipranges=(3e-4, 4e-4)),
    # DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    # arXiv 2503.14476): clip-higher (0.2 / 0.28), token-level loss (the mean over every token
    # of the batch), dynamic sampling (3 x the prompts per generation round, as verl's DAPO
    # recipe), the soft overlong punishment over the last 4096 tokens of a 20480-token budget
    # (1/5 of it) up to 1 (the score's scale: DAPO's rewards are +-1), no KL term.
    dapo=Estimator(_group_estimator("grpo"), kl_in_loss=False, loss_aggregation="token_mean",
                   min_group_size=2, group_normalised=True, clipranges=(0.2, 0.28),
                   dynamic_sampling_oversample=3, overlong_buffer_fraction=0.2,
                   overlong_penalty=1.0),
)
# Per-turn credit for multi-turn trajectories (`turn_rloo_advantages`: unbiased when the policy
# decides when to stop; `turn_index_normalised_advantages`, MT-GRPO's per-turn-index
# normalisation, to compare with), the KL in the reward as RLOO's; on one turn `turn_rloo` is
# RLOO.
ESTIMATORS.update(
    turn_rloo=Estimator(_turn_estimator("turn_rloo"), kl_in_loss=False,
                        loss_aggregation="token_mean", min_group_size=2),
    turn_grpo=Estimator(_turn_estimator("turn_grpo"), kl_in_loss=False,
                        loss_aggregation="token_mean", min_group_size=2),
)
