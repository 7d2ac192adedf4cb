"""Reference macro-action math as plain per-sample Python loops (rows, tokens, macros).

Written from the method description, independently of the vectorised code in `marl_jax.macro`.
Tests compare against it, and `experiments/bench_macro.py` times it as the per-sample loop
implementation. Segments are lists of token indices; a row's response length is the number of
ones at the start of its mask.
"""
import numpy as np


def response_length(mask_row):
    length = 0
    for m in mask_row:
        if m:
            length += 1
        else:
            break
    return length


def fixed_segments(length, n, isolate_last=True):
    """Tokens grouped n at a time; with isolate_last the final token is alone."""
    body = length - 1 if (isolate_last and length > 0) else length
    segments = []
    current = []
    for t in range(body):
        current.append(t)
        if len(current) == n:
            segments.append(current)
            current = []
    if current:
        segments.append(current)
    if body < length:
        segments.append([length - 1])
    return segments


def list_segments(length, macro_lengths, isolate_last=True):
    """Macros of the given lengths in order; what remains afterwards is one macro."""
    body = length - 1 if (isolate_last and length > 0) else length
    segments = []
    t = 0
    for size in macro_lengths:
        if t >= body:
            break
        current = []
        while len(current) < size and t < body:
            current.append(t)
            t += 1
        segments.append(current)
    if t < body:
        segments.append(list(range(t, body)))
    if body < length:
        segments.append([length - 1])
    return segments


def perplexity_segments(ref_logprobs_row, length, isolate_last=True):
    """A macro continues while perplexity does not rise; token t+1 starts one when it rises."""
    segments = []
    current = []
    for t in range(length):
        is_last = t == length - 1
        if current:
            previous_ppl = np.exp(-float(ref_logprobs_row[t - 1]))
            ppl = np.exp(-float(ref_logprobs_row[t]))
            rises = ppl > previous_ppl
            if rises or (is_last and isolate_last):
                segments.append(current)
                current = []
        current.append(t)
    if current:
        segments.append(current)
    return segments


def ids_from_segments(segments, width):
    ids = [0] * width
    for k, segment in enumerate(segments):
        for t in segment:
            ids[t] = k
    return ids


def segments_from_ids(ids_row, length):
    segments = []
    for t in range(length):
        if t == 0 or ids_row[t] != ids_row[t - 1]:
            segments.append([])
        segments[-1].append(t)
    return segments


def fixed_ngram(response_mask, n, isolate_last=True):
    mask = np.asarray(response_mask)
    out = np.zeros(mask.shape, np.int32)
    for b in range(mask.shape[0]):
        segments = fixed_segments(response_length(mask[b]), n, isolate_last)
        out[b] = ids_from_segments(segments, mask.shape[1])
    return out


def sigma(size, weighting):
    """Weights of the tokens of one macro of `size` tokens, in order."""
    if weighting == "equal":
        return [1.0 / size] * size
    if weighting == "unit":
        return [0.0] * (size - 1) + [1.0]
    if weighting == "first":
        return [1.0] + [0.0] * (size - 1)
    if weighting == "position":
        raw = [1.0 / (size - i) for i in range(size)]
        total = sum(raw)
        return [w / total for w in raw]
    raise ValueError(weighting)


def macro_gae_row(values_row, rewards_row, segments, gamma, lam, weighting, aggregation):
    macro_values = []
    macro_rewards = []
    for segment in segments:
        weights = sigma(len(segment), weighting)
        v = 0.0
        r_weighted = 0.0
        r_sum = 0.0
        for w, t in zip(weights, segment):
            v += w * float(values_row[t])
            r_weighted += w * float(rewards_row[t])
            r_sum += float(rewards_row[t])
        macro_values.append(v)
        macro_rewards.append(r_weighted if aggregation == "weighted" else r_sum)
    advantages = [0.0] * len(segments)
    next_advantage = 0.0
    next_value = 0.0
    for k in reversed(range(len(segments))):
        delta = macro_rewards[k] + gamma * next_value - macro_values[k]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[k] = next_advantage
        next_value = macro_values[k]
    width = len(values_row)
    token_advantages = [0.0] * width
    token_returns = [0.0] * width
    for k, segment in enumerate(segments):
        for t in segment:
            token_advantages[t] = advantages[k]
            token_returns[t] = advantages[k] + macro_values[k]
    return token_advantages, token_returns


def macro_gae(values, rewards, response_mask, segment_ids, gamma=1.0, lam=0.95,
              value_weighting="equal", reward_aggregation="weighted"):
    values = np.asarray(values, np.float64)
    rewards = np.asarray(rewards, np.float64)
    mask = np.asarray(response_mask)
    ids = np.asarray(segment_ids)
    advantages = np.zeros(values.shape)
    returns = np.zeros(values.shape)
    for b in range(values.shape[0]):
        segments = segments_from_ids(list(ids[b]), response_length(mask[b]))
        advantages[b], returns[b] = macro_gae_row(
            list(values[b]), list(rewards[b]), segments, gamma, lam,
            value_weighting, reward_aggregation)
    return advantages, returns


def gae_row(values, rewards, length, gamma=1.0, lam=0.95):
    """Token-level GAE of one response's first `length` tokens, the textbook backward loop
    (V after the last token 0): [length]."""
    advantages, last = np.zeros(length), 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        advantages[t] = last
    return advantages


def gae(values, rewards, response_mask, gamma=1.0, lam=0.95):
    """Token-level GAE, the textbook backward loop."""
    values = np.asarray(values, np.float64)
    rewards = np.asarray(rewards, np.float64)
    mask = np.asarray(response_mask)
    advantages = np.zeros(values.shape)
    for b in range(values.shape[0]):
        length = response_length(mask[b])
        advantages[b, :length] = gae_row(values[b], rewards[b], length, gamma, lam)
    returns = (advantages + values) * (mask != 0)
    return advantages, returns
