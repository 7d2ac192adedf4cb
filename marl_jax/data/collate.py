"""Tokenisation into the fixed shapes every stage uses.

A prompt is left-padded to `prompt_length` (truncated from the left, so the end of the prompt,
where the answer starts, is kept); a response is left-aligned and right-padded to
`response_length`, EOS included. The concatenation `[prompt | response]` is what every model
sees, with positions `cumsum(mask) - 1`.
"""
from __future__ import annotations

import numpy as np


def encode_prompts(tokenizer, prompts, prompt_length: int):
    """Returns (ids [N, P] int32, mask [N, P] int32), left-padded."""
    if prompt_length < 1:
        raise ValueError(f"prompt_length={prompt_length} must be >= 1")
    pad = _pad_id(tokenizer)
    ids = np.full((len(prompts), prompt_length), pad, np.int32)
    mask = np.zeros((len(prompts), prompt_length), np.int32)
    encoded = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    for i, row in enumerate(encoded):
        if not row:
            raise ValueError(f"prompt {i} encodes to no tokens: {prompts[i]!r}")
        row = row[-prompt_length:]
        ids[i, prompt_length - len(row):] = row
        mask[i, prompt_length - len(row):] = 1
    return ids, mask


def encode_responses(tokenizer, responses, response_length: int, *, append_eos: bool = True):
    """Returns (ids [N, R] int32, mask [N, R] int32), left-aligned, EOS appended if missing
    (with `append_eos`; without it, texts that end without the EOS token stay so, like the cut-off
    responses a policy produces at `response_length`).

    A response longer than `response_length` is truncated (and then has no EOS).
    """
    if response_length < 1:
        raise ValueError(f"response_length={response_length} must be >= 1")
    pad, eos = _pad_id(tokenizer), tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; set one before training")
    ids = np.full((len(responses), response_length), pad, np.int32)
    mask = np.zeros((len(responses), response_length), np.int32)
    encoded = tokenizer(list(responses), add_special_tokens=False)["input_ids"]
    for i, row in enumerate(encoded):
        if append_eos and (not row or row[-1] != eos):
            row = row + [eos]
        if not row:
            raise ValueError(f"response {i} encodes to no tokens: {responses[i]!r}")
        row = row[:response_length]
        ids[i, :len(row)] = row
        mask[i, :len(row)] = 1
    return ids, mask


def _pad_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    raise ValueError("the tokenizer has neither pad_token_id nor eos_token_id")
