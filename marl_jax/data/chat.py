"""Prompt formatting for instruct models, and length filtering with the model's tokenizer."""
from __future__ import annotations

from marl_jax.data.records import LoadedRecords

RESPONSE_FIELDS = ("chosen", "rejected", "response")
_CHUNK = 1024


def format_prompt(tokenizer, text, use_chat_template):
    """The prompt string the policy is conditioned on.

    Args:
      tokenizer: a `transformers` tokenizer.
      text: the raw prompt string, or a list of `{"role", "content"}` chat turns.
      use_chat_template: wrap the prompt with `tokenizer.apply_chat_template(...,
        add_generation_prompt=True)`, so generation starts at the assistant turn. A plain string
        becomes one user turn. The template usually contains the BOS text itself, so tokenize the
        result without adding special tokens again.

    Returns:
      The formatted prompt (the text unchanged when `use_chat_template` is False).
    """
    if not use_chat_template:
        if not isinstance(text, str):
            raise ValueError("text must be a string when use_chat_template is False")
        return text
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"use_chat_template=True but the tokenizer {type(tokenizer).__name__} has no "
            "chat_template")
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def format_records(records, tokenizer, use_chat_template):
    """Records with `prompt` formatted by `format_prompt` (from `messages` when a record has them).

    With a chat template the responses (`chosen`, `rejected`, `response`) lose their leading
    whitespace, which only joined them to a plain-text prompt.
    """
    formatted = []
    for record in records:
        record = dict(record)
        source = record.get("messages", record["prompt"]) if use_chat_template else record["prompt"]
        record["prompt"] = format_prompt(tokenizer, source, use_chat_template)
        if use_chat_template:
            for name in RESPONSE_FIELDS:
                if name in record:
                    record[name] = record[name].lstrip()
        formatted.append(record)
    return LoadedRecords(formatted, dict(getattr(records, "load_stats", {})))


def filter_by_length(records, tokenizer, max_prompt_tokens, max_response_tokens):
    """The records whose prompt and every response fit the token budgets.

    The prompt is counted as the model sees it with `tokenizer(prompt)` (special tokens such as
    BOS included); responses (`chosen`, `rejected`, `response`) without special tokens, so the
    EOS a trainer appends is not counted. Dropped records are counted in
    `load_stats["dropped"]["too long"]`.

    Args:
      records: a list of record dicts (a loader's result).
      tokenizer: a `transformers` tokenizer.
      max_prompt_tokens, max_response_tokens: positive budgets.
    """
    for name, value in (("max_prompt_tokens", max_prompt_tokens),
                        ("max_response_tokens", max_response_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    keep = [True] * len(records)
    prompt_lengths = _token_counts(tokenizer, [r["prompt"] for r in records], True)
    for i, length in enumerate(prompt_lengths):
        keep[i] = length <= max_prompt_tokens
    for name in RESPONSE_FIELDS:
        indices = [i for i, r in enumerate(records) if name in r]
        lengths = _token_counts(tokenizer, [records[i][name] for i in indices], False)
        for i, length in zip(indices, lengths):
            keep[i] = keep[i] and length <= max_response_tokens
    kept = [r for r, k in zip(records, keep) if k]
    stats = dict(getattr(records, "load_stats", {}))
    stats["dropped"] = dict(stats.get("dropped", {}))
    too_long = len(records) - len(kept)
    if too_long:
        stats["dropped"]["too long"] = stats["dropped"].get("too long", 0) + too_long
    stats["kept"] = len(kept)
    return LoadedRecords(kept, stats)


def _token_counts(tokenizer, texts, add_special_tokens):
    counts = []
    for start in range(0, len(texts), _CHUNK):
        encoded = tokenizer(texts[start:start + _CHUNK], add_special_tokens=add_special_tokens)
        counts.extend(len(ids) for ids in encoded["input_ids"])
    return counts
