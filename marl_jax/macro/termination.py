"""Termination conditions: how a response is cut into macro actions.

Every strategy produces the same representation: int32 segment ids `[B, T]`, one macro index per
response token. Within a row the ids are contiguous and non-decreasing, start at 0 on the first
token, and padded positions hold 0. Responses are left-aligned: `response_mask[b, :L_b] == 1`.

With `isolate_last=True` (the default, as in the official code) the last valid token is always a
macro of its own, so the reward-model score that lands there is never averaged away.

All strategies are batched and jittable. Fixed n-grams have a closed form; the others mark where
macros start (a boolean `[B, T]` mask) and turn that into ids with one cumulative sum, the path
the host-side parsing strategy also takes through `segment_ids_from_starts`.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.macro.checks import (
    check_choice,
    check_mask,
    check_rank,
    check_same_shape,
    is_concrete,
)

STRATEGIES = ("fixed", "randomized", "perplexity", "entropy", "low_probability", "step")
# One macro per assistant turn of a multi-turn trajectory (`turns`).
TURN = "turn"


def segment_ids_from_starts(starts, response_mask):
    """Segment ids from a "a macro starts at this token" mask.

    Args:
      starts: bool `[B, T]`; token 0 of every row starts a macro whatever `starts` says, and
        entries on padding are ignored.
      response_mask: `[B, T]` left-aligned 0/1 (or bool) response mask.

    Returns:
      int32 `[B, T]` segment ids. A numpy array when both inputs are numpy arrays (host-side
      callers such as the parsing strategy), a jax array otherwise.
    """
    check_rank(starts, 2, "starts")
    check_mask(response_mask, "response_mask", left_aligned=True)
    check_same_shape(response_mask, "response_mask", starts=starts)
    if is_concrete(starts):
        values = np.asarray(starts)
        if not np.all((values == 0) | (values == 1)):
            raise ValueError("starts must be a boolean (or 0/1) mask")
    xp = np if isinstance(starts, np.ndarray) and isinstance(response_mask, np.ndarray) else jnp
    return _ids_from_starts(xp.asarray(starts) != 0, xp.asarray(response_mask) != 0, xp)


def macros_per_row(segment_ids, mask):
    """int32 `[B]`: the macros of each row, of segment ids `[B, T]` contiguous from 0 over the
    row's valid tokens (`mask [B, T]`: a response's, or a trajectory's action tokens), as every
    termination gives them; 0 for a row without valid tokens."""
    valid = jnp.asarray(mask) != 0
    return (jnp.where(valid, jnp.asarray(segment_ids), -1).max(axis=1) + 1).astype(jnp.int32)


def mean_macro_length(segment_ids, mask):
    """Tokens per macro over a batch (float32 scalar): the valid tokens of `mask [B, T]` over the
    macros of `segment_ids [B, T]` (`macros_per_row`); 0 without valid tokens. The matched
    token control's L (lam^(1/L)) and the step's `macro/len_avg`."""
    tokens = (jnp.asarray(mask) != 0).sum().astype(jnp.float32)
    return tokens / jnp.maximum(macros_per_row(segment_ids, mask).sum(), 1).astype(jnp.float32)


def fixed_ngram(response_mask, n, *, isolate_last=True):
    """Fixed n-gram macros: tokens 0..L-2 grouped by `t // n`, the last token alone.

    Without `isolate_last`, tokens 0..L-1 are grouped by `t // n`. No macro is ever empty.

    Args:
      response_mask: `[B, T]` left-aligned response mask.
      n: macro length, a Python int or an int32 scalar (possibly traced, e.g. vmapped over
        experiment arms); must be >= 1. A traced `n` below 1 is treated as 1.
      isolate_last: make the last valid token its own macro.

    Returns:
      int32 `[B, T]` segment ids.
    """
    _check_positive_int(n, "n")
    _check_response_mask(response_mask)
    return _fixed_ngram(response_mask, n, isolate_last=isolate_last)


def randomized_ngram(key, response_mask, *, lengths=(2, 3, 5, 10), repeats=3, isolate_last=True):
    """Randomised n-gram macros: lengths taken in order from a per-row shuffled length list.

    Each row gets an independent permutation of `lengths * repeats` (the list repeated); once it
    is exhausted the rest of the response (before the isolated last token) is one macro.

    Args:
      key: a `jax.random` key.
      response_mask: `[B, T]` left-aligned response mask.
      lengths: macro lengths (Python ints >= 1).
      repeats: how many times the length list is repeated before shuffling (>= 1).
      isolate_last: make the last valid token its own macro.

    Returns:
      int32 `[B, T]` segment ids.
    """
    lengths = tuple(lengths)
    if not lengths:
        raise ValueError("lengths must not be empty")
    for length in lengths:
        _check_positive_int(length, "lengths")
    _check_positive_int(repeats, "repeats")
    lengths = tuple(int(length) for length in lengths)
    if key is None:
        raise ValueError("key is required for the randomized strategy")
    _check_response_mask(response_mask)
    return _randomized_ngram(key, response_mask, lengths=lengths, repeats=int(repeats),
                             isolate_last=isolate_last)


def perplexity(ref_logprobs, response_mask, *, isolate_last=True):
    """Perplexity macros: a macro continues while per-token perplexity does not rise.

    With ppl_t = exp(-ref_logprobs[t]), token t + 1 starts a new macro exactly when
    ppl_{t+1} > ppl_t, i.e. ref_logprobs[t + 1] < ref_logprobs[t] (compared in log space, so
    there is no overflow).

    Args:
      ref_logprobs: float `[B, T]` log-probabilities of the response tokens under the reference
        model.
      response_mask: `[B, T]` left-aligned response mask.
      isolate_last: make the last valid token its own macro.

    Returns:
      int32 `[B, T]` segment ids.
    """
    check_rank(ref_logprobs, 2, "ref_logprobs")
    _check_response_mask(response_mask)
    check_same_shape(response_mask, "response_mask", ref_logprobs=ref_logprobs)
    return _perplexity(ref_logprobs, response_mask, isolate_last=isolate_last)


def entropy_spans(entropies, response_mask, *, quantile, isolate_last=True):
    """Entropy macros: a macro starts at each "forking token", one of high sampling entropy.

    In each row, token t starts a macro when its entropy is at least the row's threshold, the
    k-th largest entropy among the row's L valid tokens with k = ceil(quantile * L): the top
    `quantile` fraction of the row's tokens, plus any tied with the k-th (ties at the threshold
    all start macros). Token 0 always starts one. Padding takes no part in the threshold. The
    product quantile * L is read with a relative tolerance of 1e-6, so that float rounding
    (0.2 * 5 is 1.0000000298 in float32) does not add a token. `quantile = 1` gives one token
    per macro.

    Args:
      entropies: float `[B, T]` entropy of the sampling distribution at each response token.
      response_mask: `[B, T]` left-aligned response mask.
      quantile: fraction of each row's valid tokens that start macros, in (0, 1]; a Python float
        or a (traced) float scalar.
      isolate_last: make the last valid token its own macro.

    Returns:
      int32 `[B, T]` segment ids.
    """
    check_rank(entropies, 2, "entropies")
    _check_response_mask(response_mask)
    check_same_shape(response_mask, "response_mask", entropies=entropies)
    _check_share(quantile, "quantile")
    return _entropy_spans(entropies, response_mask, quantile, isolate_last=isolate_last)


def low_probability(logprobs, response_mask, *, quantile=None, threshold=None, isolate_last=True):
    """Low-probability macros (SAE, Gong et al. 2026, arXiv 2601.07320): a macro ends after a
    token that the policy sampled with low probability.

    Token t ends its macro (token t + 1 starts the next) when, with `threshold`, its probability
    is below it (`logprobs[t] < log(threshold)`, compared in log space), or, with `quantile`, its
    logprob is at most the row's k-th lowest among the row's L valid tokens, k = ceil(quantile *
    L): the lowest `quantile` share of the row's tokens, plus any tied with the k-th (the product
    read with `entropy_spans`' relative tolerance of 1e-6). Exactly one of the two is given.
    Token 0 always starts a macro; padding takes no part. `quantile = 1` gives one token per
    macro.

    Which logprobs: the probability the rollout policy gave each token it sampled, which a PPO
    step holds as its old logprobs (`Experience.old_logprobs`, the ratio's denominator): the
    numbers SAE thresholds, always kept (the sampler's own are kept only under a rollout
    correction), and the sampler's to ~1e-5 at any temperature in float32 without top-k / top-p
    (the temperature-scaled policy; with top-k / top-p the sampler renormalises over the kept
    tokens, the old logprobs do not).

    Args:
      logprobs: float `[B, T]` log-probabilities of the response tokens under the policy that
        sampled them.
      response_mask: `[B, T]` left-aligned response mask.
      quantile: fraction of each row's valid tokens that end macros, in (0, 1]; a Python float
        or a (traced) float scalar.
      threshold: probability below which a token ends its macro, in (0, 1]; a Python float or a
        (traced) float scalar.
      isolate_last: make the last valid token its own macro.

    Returns:
      int32 `[B, T]` segment ids.
    """
    check_rank(logprobs, 2, "logprobs")
    _check_response_mask(response_mask)
    check_same_shape(response_mask, "response_mask", logprobs=logprobs)
    if (quantile is None) == (threshold is None):
        raise ValueError("low_probability takes exactly one of quantile and threshold, got "
                         f"quantile={quantile!r}, threshold={threshold!r}")
    name, level = ("quantile", quantile) if threshold is None else ("threshold", threshold)
    _check_share(level, name)
    return _low_probability(logprobs, response_mask, level, by_quantile=threshold is None,
                            isolate_last=isolate_last)


def reasoning_steps(token_ids, response_mask, table, *, isolate_last=True):
    """Reasoning-step macros (SPO's and process-reward work's steps of a chain of thought): a
    macro ends at the token that holds the first character of a delimiter (`table.delimiters`,
    e.g. a newline or ". ") in the decoded response, wherever the tokens split or merge it.

    `table` (`macro.steps.step_table`, built once from the tokenizer) gives each vocabulary
    entry's transitions of an automaton that reads the text backwards; here one associative scan
    composes them along each row (see `marl_jax.macro.steps`). An id outside the table (a
    model's padded embedding rows) adds no text.

    Args:
      token_ids: int `[B, T]` the response tokens.
      response_mask: `[B, T]` left-aligned response mask.
      table: a `macro.steps.StepTable` (or anything with its `transitions [V, S]` and
        `hits [V, S]`).
      isolate_last: make the last valid token its own macro.

    Returns:
      int32 `[B, T]` segment ids.
    """
    check_rank(token_ids, 2, "token_ids")
    _check_response_mask(response_mask)
    check_same_shape(response_mask, "response_mask", token_ids=token_ids)
    return _reasoning_steps(token_ids, response_mask, table.transitions, table.hits,
                            isolate_last=isolate_last)


@functools.partial(jax.jit, static_argnames="isolate_last")
def _reasoning_steps(token_ids, response_mask, transitions, hits, *, isolate_last):
    valid = response_mask != 0
    ends = _step_ends(token_ids, valid, jnp.zeros_like(valid), transitions, hits)
    starts = jnp.concatenate([jnp.ones_like(ends[:, :1]), ends[:, :-1]], axis=1)
    return _finish(starts, valid, isolate_last)


def _step_ends(token_ids, valid, restarts, transitions, hits):
    """bool `[B, T]`: the valid tokens that hold a delimiter's first character, the text read
    backwards from each row's end; the automaton restarts at the `restarts` tokens (a turn's
    last action token: no delimiter spans two turns) and passes over the invalid ones."""
    token_ids = jnp.asarray(token_ids)
    transitions, hits = jnp.asarray(transitions, jnp.int32), jnp.asarray(hits)
    vocab, width = transitions.shape
    known = valid & (token_ids >= 0) & (token_ids < vocab)
    safe = jnp.where(known, token_ids, 0)
    functions = jnp.where(known[..., None], transitions[safe], jnp.arange(width, dtype=jnp.int32))
    found = hits[safe] & known[..., None]
    functions = jnp.where(restarts[..., None], functions[..., :1], functions)
    found = jnp.where(restarts[..., None], found[..., :1], found)
    # composed[t][s]: the state after reading tokens T-1, ..., t (backwards) from state s.
    composed = jax.lax.associative_scan(
        lambda later, earlier: jnp.take_along_axis(earlier, later, axis=-1), functions,
        reverse=True, axis=1)
    entering = jnp.concatenate([composed[:, 1:, 0], jnp.zeros_like(composed[:, :1, 0])], axis=1)
    return jnp.take_along_axis(found, entering[..., None], axis=-1)[..., 0]


def segment(strategy, response_mask, *, key=None, ref_logprobs=None, entropies=None,
            logprobs=None, n=5, lengths=(2, 3, 5, 10), repeats=3, entropy_quantile=0.2,
            low_probability_quantile=0.2, low_probability_threshold=None, isolate_last=True,
            turn_ids=None, token_ids=None, step_table=None):
    """Segment ids `[B, T]` for one of `STRATEGIES` ("parsing" runs host-side, in parsing.py),
    or `TURN` (one macro per turn: `turns`, which needs `turn_ids`).

    `key` is required by "randomized", `ref_logprobs` by "perplexity", `entropies` by
    "entropy", `logprobs` (the sampling policy's) by "low_probability"; `n` is used by "fixed",
    `lengths` and `repeats` by "randomized", `entropy_quantile` by "entropy", and by
    "low_probability" `low_probability_threshold` when it is not None, else
    `low_probability_quantile`; "step" reads `token_ids` (the response's, or the trajectory's
    tokens) and `step_table` (`macro.steps.step_table`).

    With `turn_ids` (int `[B, T]`, a multi-turn trajectory's turn of each token) the strategy
    runs within turns: `response_mask` is the action mask (observation spans are holes), a turn
    boundary always ends a macro, fixed n-grams restart at every turn, and with `isolate_last`
    each turn's last action token (where a per-turn reward lands) is a macro of its own. The
    other strategies read the row's action tokens as one response (a quantile is a share of the
    whole trajectory's action tokens) and the turn boundaries are added to their cuts; "step"
    reads each turn's text on its own.
    """
    check_choice(strategy, STRATEGIES + (TURN,), "strategy")
    if strategy == "step" and (token_ids is None or step_table is None):
        raise ValueError("the step strategy needs token_ids and a step_table "
                         "(macro.steps.step_table of the tokenizer)")
    if strategy == TURN:
        if turn_ids is None:
            raise ValueError("the turn strategy needs turn_ids (a multi-turn trajectory)")
        return turns(turn_ids, response_mask)
    if turn_ids is not None:
        return _within_turns(strategy, response_mask, turn_ids, key=key,
                             ref_logprobs=ref_logprobs, entropies=entropies, logprobs=logprobs,
                             n=n, lengths=lengths, repeats=repeats,
                             entropy_quantile=entropy_quantile,
                             low_probability_quantile=low_probability_quantile,
                             low_probability_threshold=low_probability_threshold,
                             isolate_last=isolate_last, token_ids=token_ids,
                             step_table=step_table)
    if strategy == "step":
        return reasoning_steps(token_ids, response_mask, step_table, isolate_last=isolate_last)
    if strategy == "fixed":
        return fixed_ngram(response_mask, n, isolate_last=isolate_last)
    if strategy == "randomized":
        return randomized_ngram(key, response_mask, lengths=lengths, repeats=repeats,
                                isolate_last=isolate_last)
    if strategy == "entropy":
        if entropies is None:
            raise ValueError("entropies is required for the entropy strategy")
        return entropy_spans(entropies, response_mask, quantile=entropy_quantile,
                             isolate_last=isolate_last)
    if strategy == "low_probability":
        if logprobs is None:
            raise ValueError("logprobs (the sampling policy's) is required for the "
                             "low_probability strategy")
        if low_probability_threshold is not None:
            return low_probability(logprobs, response_mask, threshold=low_probability_threshold,
                                   isolate_last=isolate_last)
        return low_probability(logprobs, response_mask, quantile=low_probability_quantile,
                               isolate_last=isolate_last)
    if ref_logprobs is None:
        raise ValueError("ref_logprobs is required for the perplexity strategy")
    return perplexity(ref_logprobs, response_mask, isolate_last=isolate_last)


def _within_turns(strategy, action_mask, turn_ids, *, isolate_last, n, ref_logprobs,
                  entropies, logprobs, token_ids, step_table, **settings):
    check_rank(turn_ids, 2, "turn_ids")
    check_mask(action_mask, "action_mask", left_aligned=False)
    check_same_shape(action_mask, "action_mask", turn_ids=turn_ids)
    valid = jnp.asarray(action_mask) != 0
    turn_ids = jnp.asarray(turn_ids, jnp.int32)
    if strategy == "fixed":
        _check_positive_int(n, "n")
        ranks = _rank_in_turn(valid, turn_ids)
        starts = ranks % jnp.maximum(jnp.asarray(n, jnp.int32), 1) == 0
    elif strategy == "step":
        check_same_shape(action_mask, "action_mask", token_ids=token_ids)
        starts = _step_starts_within_turns(token_ids, valid, turn_ids, step_table.transitions,
                                           step_table.hits)
    else:
        order, inverse = _actions_first(valid)
        compact = lambda x: None if x is None else jnp.take_along_axis(  # noqa: E731
            jnp.asarray(x), order, axis=1)
        ids = segment(strategy, compact(valid).astype(jnp.int32), n=n,
                      ref_logprobs=compact(ref_logprobs), entropies=compact(entropies),
                      logprobs=compact(logprobs), isolate_last=False, **settings)
        starts = _starts(valid, jnp.take_along_axis(ids, inverse, axis=1))
    starts = starts | _starts(valid, turn_ids)
    if isolate_last:
        starts = starts | _after_last_of_turn(valid, turn_ids)
    return jnp.where(valid, jnp.cumsum(starts & valid, axis=1, dtype=jnp.int32) - 1, 0)


def _actions_first(valid):
    """(order, inverse) `[B, T]`: `take_along_axis(x, order)` moves each row's action tokens to
    its front, in order (a left-aligned response); `inverse` moves them back."""
    order = jnp.argsort(~valid, axis=1, stable=True)
    return order, jnp.argsort(order, axis=1, stable=True)


def _starts(valid, ids):
    """bool `[B, T]`: the action tokens whose `ids` differ from the previous action token's."""
    seen = jax.lax.cummax(jnp.where(valid, ids, jnp.iinfo(jnp.int32).min), axis=1)
    previous = jnp.concatenate([jnp.full_like(seen[:, :1], jnp.iinfo(jnp.int32).min),
                                seen[:, :-1]], axis=1)
    return valid & (ids != previous)


@jax.jit
def _step_starts_within_turns(token_ids, valid, turn_ids, transitions, hits):
    """bool `[B, T]`: the action tokens that follow one holding a delimiter's first character,
    each turn's text read on its own."""
    ends = _step_ends(token_ids, valid, _after_last_of_turn(valid, turn_ids), transitions, hits)
    positions = jnp.where(valid, jnp.arange(valid.shape[1]), -1)
    seen = jax.lax.cummax(positions, axis=1)
    previous = jnp.concatenate([jnp.full_like(seen[:, :1], -1), seen[:, :-1]], axis=1)
    ended = jnp.take_along_axis(ends, jnp.maximum(previous, 0), axis=1)
    return valid & (previous >= 0) & ended


def _rank_in_turn(valid, turn_ids):
    """int32 `[B, T]`: each action token's index among its turn's action tokens."""
    ranks = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
    first = jnp.where(_starts(valid, turn_ids), ranks, -1)
    return ranks - jax.lax.cummax(first, axis=1)


def _after_last_of_turn(valid, turn_ids):
    """bool `[B, T]`: the action tokens that follow the last action token of a turn, and that
    last token itself, so it is a macro of its own."""
    starts = _starts(valid, turn_ids)
    width = valid.shape[1]
    # The next action token's position (width after the last one).
    following = jax.lax.cummin(jnp.where(valid, jnp.arange(width), width), axis=1,
                               reverse=True)
    following = jnp.concatenate([following[:, 1:], jnp.full_like(following[:, :1], width)],
                                axis=1)
    next_starts = jnp.take_along_axis(jnp.concatenate(
        [starts, jnp.ones_like(starts[:, :1])], axis=1), following, axis=1)
    return valid & next_starts


def turns(turn_ids, action_mask):
    """Turn macros: one macro per assistant turn of a multi-turn trajectory (AReaL's turn-level
    GAE unit, `gae_timestep_unit: turn`).

    Args:
      turn_ids: int `[B, T]` the turn index of each token, non-decreasing along a row.
      action_mask: `[B, T]` 0/1 mask of the policy's tokens; the observation spans between turns
        are holes.

    Returns:
      int32 `[B, T]` segment ids over the action tokens: a macro starts at every action token
      whose turn is not the previous action token's, so a turn's action tokens (however a hole
      splits them) are one macro; 0 off the action tokens.
    """
    check_rank(turn_ids, 2, "turn_ids")
    check_mask(action_mask, "action_mask", left_aligned=False)
    check_same_shape(action_mask, "action_mask", turn_ids=turn_ids)
    if is_concrete(turn_ids) and np.any(np.diff(np.asarray(turn_ids), axis=1) < 0):
        raise ValueError("turn_ids must be non-decreasing along each row")
    return _turns(jnp.asarray(turn_ids, jnp.int32), jnp.asarray(action_mask))


@jax.jit
def _turns(turn_ids, action_mask):
    valid = action_mask != 0
    seen = jax.lax.cummax(jnp.where(valid, turn_ids, -1), axis=1)
    previous = jnp.concatenate([jnp.full_like(seen[:, :1], -1), seen[:, :-1]], axis=1)
    starts = valid & (turn_ids != previous)
    return jnp.where(valid, jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1, 0)


def _check_positive_int(value, name):
    if not is_concrete(value):
        return
    array = np.asarray(value)
    if array.ndim != 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must be an integer scalar, got {value!r}")
    if int(array) < 1:
        raise ValueError(f"{name} must be >= 1, got {int(array)}")


def _check_share(value, name):
    """A concrete `value` must be a scalar in (0, 1] (a quantile or a probability)."""
    if not is_concrete(value):
        return
    array = np.asarray(value)
    if array.ndim != 0 or not np.issubdtype(array.dtype, np.number) or not 0 < float(array) <= 1:
        raise ValueError(f"{name} must be a scalar in (0, 1], got {value!r}")


def _check_response_mask(response_mask):
    check_mask(response_mask, "response_mask", left_aligned=True)


@functools.partial(jax.jit, static_argnames="isolate_last")
def _fixed_ngram(response_mask, n, *, isolate_last):
    valid = response_mask != 0
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 1)
    # Closed form rather than starts + cumsum: this strategy sits on the hot path of every step.
    positions = jnp.arange(valid.shape[1], dtype=jnp.int32)
    lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)[:, None]
    ids = positions // n
    if isolate_last:
        last_id = jnp.where(lengths >= 2, (lengths - 2) // n + 1, 0)
        ids = jnp.where(positions == lengths - 1, last_id, ids)
    return jnp.where(valid, ids, 0)


@functools.partial(jax.jit, static_argnames=("lengths", "repeats", "isolate_last"))
def _randomized_ngram(key, response_mask, *, lengths, repeats, isolate_last):
    valid = response_mask != 0
    batch, width = valid.shape
    pool = jnp.broadcast_to(jnp.asarray(lengths * repeats, jnp.int32),
                            (batch, len(lengths) * repeats))
    order = jax.random.permutation(key, pool, axis=1, independent=True)
    # Macro k + 1 starts where macro k ends; the last end is where the remainder macro starts.
    boundaries = jnp.cumsum(order, axis=1)
    rows = jnp.arange(batch)[:, None]
    starts = jnp.zeros((batch, width), bool).at[rows, boundaries].set(True, mode="drop")
    return _finish(starts, valid, isolate_last)


@functools.partial(jax.jit, static_argnames="isolate_last")
def _perplexity(ref_logprobs, response_mask, *, isolate_last):
    valid = response_mask != 0
    rises = ref_logprobs[:, 1:] < ref_logprobs[:, :-1]
    # Token 0 starts the first macro; built from the batch size, since `rises` is empty at T = 1.
    starts = jnp.concatenate([jnp.ones((valid.shape[0], 1), bool), rises], axis=1)
    return _finish(starts, valid, isolate_last)


@functools.partial(jax.jit, static_argnames="isolate_last")
def _entropy_spans(entropies, response_mask, quantile, *, isolate_last):
    valid = response_mask != 0
    return _finish(_top_share(_as_float(entropies), valid, quantile), valid, isolate_last)


@functools.partial(jax.jit, static_argnames=("by_quantile", "isolate_last"))
def _low_probability(logprobs, response_mask, level, *, by_quantile, isolate_last):
    valid = response_mask != 0
    logprobs = _as_float(logprobs)
    if by_quantile:
        low = _top_share(-logprobs, valid, level)
    else:
        low = logprobs < jnp.log(jnp.asarray(level, logprobs.dtype))
    # A low-probability token ends its macro: the token after it starts the next one.
    starts = jnp.concatenate([jnp.ones_like(low[:, :1]), low[:, :-1]], axis=1)
    return _finish(starts, valid, isolate_last)


def _as_float(x):
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _top_share(scores, valid, quantile):
    """bool `[B, T]`: the tokens whose score is at least the row's k-th largest among its L
    valid tokens, k = ceil(quantile * L) (ties with the k-th included; entries on padding are
    not read, and may be set)."""
    lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)
    # k = ceil(quantile * L), shrunk by a relative 1e-6 so that a product that is an integer up
    # to rounding is not pushed to the next one.
    scaled = jnp.asarray(quantile, jnp.float32) * lengths.astype(jnp.float32)
    k = jnp.ceil(scaled * (1 - 1e-6)).astype(jnp.int32)
    k = jnp.clip(k, 1, jnp.maximum(lengths, 1))
    descending = -jnp.sort(jnp.where(valid, -scores, jnp.inf), axis=1)
    threshold = jnp.take_along_axis(descending, (k - 1)[:, None], axis=1)
    return scores >= threshold


def _finish(starts, valid, isolate_last):
    if isolate_last:
        starts = starts | _last_token(valid)
    return _ids_from_starts(starts, valid, jnp)


def _last_token(valid):
    """bool `[B, T]`: the last valid token of each row."""
    next_valid = jnp.concatenate([valid[:, 1:], jnp.zeros_like(valid[:, :1])], axis=1)
    return valid & ~next_valid


def _ids_from_starts(starts, valid, xp):
    first = xp.arange(valid.shape[1]) == 0
    begins = (starts | first) & valid
    ids = xp.cumsum(begins, axis=1, dtype=xp.int32) - 1
    return xp.where(valid, ids, 0).astype(xp.int32)
