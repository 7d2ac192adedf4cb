"""Token-in-token-out turns through a tokenizer's chat template.

A multi-turn trajectory is one token sequence: the first prompt, then each action as the policy
sampled it (ending with the template's end-of-turn token), then the environment's observation
span, and so on. The observation span is what the template writes between two assistant turns:
the markers that close the assistant turn beyond the sampled end token (e.g. ChatML's newline
after `<|im_end|>`), the observation as a `user` or `tool` message, and the generation prompt
that opens the next assistant turn. It is derived from the template itself: the conversation is
rendered without and with the new message, and the span is the difference of the token ids after
the last end-of-turn token. The earlier tokens must be the same in both renderings; a template
that re-renders earlier turns once a message follows (e.g. one that strips an assistant turn's
reasoning) cannot be extended token by token and is refused.

Token ids are those of `tokenizer(text, add_special_tokens=False)` on the rendered text, what
`tokenizer.apply_chat_template(..., tokenize=True)` gives.
"""
from __future__ import annotations

from typing import Sequence

_PROBE = "turn-probe-0d5e"


def require_chat_template(tokenizer) -> None:
    """ValueError unless `tokenizer` has a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer {type(tokenizer).__name__} has no chat_template; "
                         "multi-turn environments need one")


def _render_text(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    require_chat_template(tokenizer)
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as error:
        roles = [m.get("role") for m in messages]
        raise ValueError(f"the chat template cannot render messages with roles {roles}: "
                         f"{error}") from None


def render_ids(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool) -> list:
    """Token ids of `messages` rendered by the tokenizer's chat template."""
    text = _render_text(tokenizer, messages, add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer, messages: Sequence[dict]) -> list:
    """Token ids of the first prompt: `messages` and the generation prompt."""
    return render_ids(tokenizer, messages, add_generation_prompt=True)


def _special_ids(tokenizer) -> set:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}


def end_of_turn_ids(tokenizer) -> tuple:
    """The special tokens the template writes right after an assistant message's content (one
    for every common template: ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`, Gemma's
    `<end_of_turn>`). The policy's turn ends when it samples the first of them; the others, if
    any, belong to the observation span."""
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": _PROBE}]
    text = _render_text(tokenizer, messages, False)
    at = text.rfind(_PROBE)
    if at < 0:
        raise ValueError("the chat template does not write an assistant message's content "
                         "verbatim, so its end-of-turn token cannot be found")
    tail = tokenizer(text[at + len(_PROBE):], add_special_tokens=False)["input_ids"]
    special = _special_ids(tokenizer)
    ids = []
    for token in tail:
        if token not in special:
            break
        ids.append(int(token))
    if not ids:
        raise ValueError("the chat template closes an assistant message with no special token "
                         f"(it writes {text[at + len(_PROBE):]!r}), so a turn has no end token")
    return tuple(ids)


def observation_span(tokenizer, messages: Sequence[dict], observation: str, *,
                     role: str = "user") -> list:
    """Token ids to append after the last assistant turn of `messages` (which ended with its
    end-of-turn token) so that the trajectory continues with `observation` as a `role` message
    and opens the next assistant turn.

    Args:
      tokenizer: a `transformers` tokenizer with a chat template.
      messages: the conversation so far, `[{"role", "content"}]`, its last message the
        assistant's (the text of the action just sampled).
      observation: the environment's text.
      role: "user" or "tool".
    Returns:
      The span's token ids: `ids(messages + [observation], generation prompt)` after the end
      token that closes the last assistant turn.
    """
    messages = list(messages)
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("observation_span needs a conversation that ends with an assistant "
                         "message")
    if not isinstance(observation, str):
        raise ValueError(f"an observation must be a str, got {type(observation).__name__}")
    end = end_of_turn_ids(tokenizer)[0]
    before = render_ids(tokenizer, messages, add_generation_prompt=False)
    after = render_ids(tokenizer, messages + [{"role": role, "content": observation}],
                       add_generation_prompt=True)
    ends = [i for i, token in enumerate(before) if token == end]
    if not ends:
        raise ValueError("the chat template renders the conversation without its end-of-turn "
                         f"token {end}")
    cut = ends[-1] + 1
    if after[:cut] != before[:cut]:
        first = next(i for i in range(cut) if i >= len(after) or after[i] != before[i])
        raise ValueError(f"the chat template renders the earlier turns differently once a "
                         f"{role} message follows (from token {first} on; e.g. it strips an "
                         "assistant turn's reasoning), so turns cannot be appended token by token")
    return after[cut:]
