"""Whole conversations (SFT demonstrations) as the token sequences of the multi-turn rollout.

A conversation `[{"role", "content"}]` is a prompt (the messages up to the first assistant one),
then assistant turns, each but the last followed by one observation (a `user` or `tool`
message). Its trajectory is what `marl_jax.rollout.turns` builds when a policy writes those
assistant turns against an environment that answers those observations
(`marl_jax.envs.turn_callback`): the prompt's ids with the generation prompt
(`chat_turns.prompt_ids`), then per turn the assistant's content tokens and the template's
end-of-turn token (the action, sampled by the policy), then the observation span
(`chat_turns.observation_span`: written by the environment).

`transcript_arrays` lays N conversations out as the SFT stage's arrays plus the trajectory's
per-token kinds and turns: the prompt left-padded to P, the rest left-aligned in a budget of R
tokens (actions and observations), `action_mask` 1 on the action tokens, `turn_ids` the turn of
each token (an observation span carries the turn it follows, padding the last turn).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from marl_jax.envs.chat_turns import end_of_turn_ids, observation_span, prompt_ids, render_ids


class Transcript(NamedTuple):
    """One conversation's trajectory as token lists.

    prompt: [P_i] the first prompt's ids (generation prompt included).
    response: [L_i] everything after it: actions and observation spans.
    action: [L_i] 1 on the assistant's tokens (end-of-turn token included), 0 on observations.
    turns: [L_i] the assistant turn (0, 1, ...) each token belongs to or follows.
    """

    prompt: list
    response: list
    action: list
    turns: list


def _check_conversation(messages: Sequence[dict]) -> int:
    """The index of the first assistant message; ValueError unless `messages` is a prompt, then
    assistant messages with one observation between each two, ending with the assistant's."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content' (str)")
    roles = [m["role"] for m in messages]
    first = roles.index("assistant") if "assistant" in roles else 0
    if first == 0:
        raise ValueError(f"a transcript needs a prompt and then an assistant message, got roles "
                         f"{roles}")
    rest = roles[first:]
    if rest[-1] != "assistant" or any((r == "assistant") != (i % 2 == 0)
                                      for i, r in enumerate(rest)):
        raise ValueError(f"after the prompt a transcript alternates assistant messages and one "
                         f"observation each, ending with the assistant's; got roles {roles}")
    return first


def transcript_tokens(tokenizer, messages: Sequence[dict]) -> Transcript:
    """The rollout's trajectory of the conversation `messages` (see the module).

    Raises ValueError where the template's rendering of the whole conversation differs from the
    turns' tokens (a tokenizer that merges tokens across a turn's boundary), so the arrays are
    always the chat template's tokens of the conversation."""
    messages = list(messages)
    first = _check_conversation(messages)
    end = end_of_turn_ids(tokenizer)[0]
    prompt = prompt_ids(tokenizer, messages[:first])
    response, action, turns = [], [], []
    for turn, at in enumerate(range(first, len(messages), 2)):
        ids = list(tokenizer(messages[at]["content"], add_special_tokens=False)["input_ids"])
        ids.append(end)
        response += ids
        action += [1] * len(ids)
        turns += [turn] * len(ids)
        if at + 1 < len(messages):
            observation = messages[at + 1]
            span = observation_span(tokenizer, messages[:at + 1], observation["content"],
                                    role=observation["role"])
            response += span
            action += [0] * len(span)
            turns += [turn] * len(span)
    whole = render_ids(tokenizer, messages, add_generation_prompt=False)
    trajectory = prompt + response
    if whole[:len(trajectory)] != trajectory:
        at = next(i for i, t in enumerate(trajectory) if i >= len(whole) or whole[i] != t)
        raise ValueError(f"the chat template's tokens of the conversation differ from its "
                         f"turns' tokens at token {at}: the tokenizer merges across a turn")
    return Transcript(prompt, response, action, turns)


def pad_id(tokenizer) -> int:
    """The id that fills padding: the tokenizer's pad token, else its EOS."""
    for token in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token is not None:
            return int(token)
    raise ValueError("the tokenizer has neither pad_token_id nor eos_token_id")


def left_padded(rows: Sequence[Sequence[int]], length: int, pad: int, *,
                field: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids [N, length] int32, mask [N, length] int32) of token lists, left-padded; a row
    longer than `length` is refused naming `field` (the config field to raise)."""
    ids = np.full((len(rows), length), pad, np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for i, row in enumerate(rows):
        if not 0 < len(row) <= length:
            raise ValueError(f"{field}={length}: prompt {i} takes {len(row)} tokens; "
                             f"{'raise ' + field if row else 'it must not be empty'}")
        ids[i, length - len(row):] = row
        mask[i, length - len(row):] = 1
    return ids, mask


def transcript_arrays(tokenizer, conversations: Sequence[Sequence[dict]], prompt_length: int,
                      response_length: int, *,
                      prompt_field: str = "config.task.prompt_length",
                      response_field: str = "config.ppo.response_length") -> dict:
    """The trajectories of N conversations as arrays (see the module).

    Returns:
      dict of int32 arrays: prompt_ids, prompt_mask [N, P] (left-padded); response_ids,
      response_mask [N, R] (left-aligned, the mask 1 on every token after the prompt),
      action_mask [N, R] (1 on the assistant's tokens), turn_ids [N, R].
    Raises ValueError naming `prompt_field` / `response_field` for a conversation whose prompt
    or rest does not fit.
    """
    transcripts = [transcript_tokens(tokenizer, messages) for messages in conversations]
    pad = pad_id(tokenizer)
    prompt_ids_, prompt_mask = left_padded([t.prompt for t in transcripts], prompt_length, pad,
                                           field=prompt_field)
    n, r = len(transcripts), response_length
    out = dict(response_ids=np.full((n, r), pad, np.int32),
               response_mask=np.zeros((n, r), np.int32),
               action_mask=np.zeros((n, r), np.int32),
               turn_ids=np.zeros((n, r), np.int32))
    for i, t in enumerate(transcripts):
        length = len(t.response)
        if length > r:
            raise ValueError(f"{response_field}={r}: demonstration {i} takes {length} tokens "
                             f"of actions and observations; raise {response_field}")
        out["response_ids"][i, :length] = t.response
        out["response_mask"][i, :length] = 1
        out["action_mask"][i, :length] = t.action
        out["turn_ids"][i, :length] = t.turns
        out["turn_ids"][i, length:] = t.turns[-1]
    return dict(prompt_ids=prompt_ids_, prompt_mask=prompt_mask, **out)
