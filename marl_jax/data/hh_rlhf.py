"""Anthropic HH-RLHF as Dahoas/full-hh-rlhf: rows `{prompt, response, chosen, rejected}`.

The prompt is the dialogue so far,
"\\n\\nHuman: ...\\n\\nAssistant: ...\\n\\nHuman: ...\\n\\nAssistant:", used as stored;
chosen and rejected are its two continuations (they start with a space), also used as stored.
Rows whose chosen and rejected texts are identical carry no preference and are dropped. Records
also carry `messages`, the dialogue as chat turns, for chat-template prompts.
"""
import re

from marl_jax.data.records import DroppedRow, text_field

_TURN = re.compile(r"\n\n(Human|Assistant):")
_ROLES = {"Human": "user", "Assistant": "assistant"}


def messages(prompt):
    """The dialogue as `[{"role", "content"}]` turns, without the open final Assistant turn.

    A prompt that does not follow the Human/Assistant layout becomes a single user turn.
    """
    parts = _TURN.split(prompt)
    if parts[0].strip() or len(parts) < 3:
        return [{"role": "user", "content": prompt.strip()}]
    turns = [{"role": _ROLES[role], "content": content.strip()}
             for role, content in zip(parts[1::2], parts[2::2])]
    if turns[-1]["role"] == "assistant" and not turns[-1]["content"]:
        turns.pop()
    return turns


def preference_pair(row):
    prompt = text_field(row, "prompt")
    chosen, rejected = text_field(row, "chosen"), text_field(row, "rejected")
    if chosen.strip() == rejected.strip():
        raise DroppedRow("identical chosen and rejected")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected,
            "messages": messages(prompt)}


def prompt_record(row):
    prompt = text_field(row, "prompt")
    return {"prompt": prompt, "messages": messages(prompt)}


def sft_example(row):
    prompt = text_field(row, "prompt")
    return {"prompt": prompt, "response": text_field(row, "chosen"),
            "messages": messages(prompt)}
