"""Reasoning-step boundaries of a vocabulary: the tables the step termination
(`termination.reasoning_steps`) reads on the device.

A reasoning step ends where a delimiter occurs in the decoded response (a newline, or a sentence
end: ". ", "? ", "! "), as SPO and process-reward work segment chains of thought. The token that
holds a delimiter's first character ends its macro: with ". " the "." (the space usually opens
the next word's token), with "\\n" the newline's.

Delimiters may straddle tokens ("." then " The") or share one with other text (".\\n\\n",
"?)"), so a token's text alone does not say whether it ends a step. The rule is exact instead:
an automaton (Aho-Corasick's, over the reversed delimiters) reads the response's text backwards,
and a match of a reversed delimiter ends on its first character. Its transitions are tabulated
once per vocabulary entry: from each automaton state, the state after reading the token's text
backwards (`transitions [V, S]`) and whether a match ended inside it (`hits [V, S]`). On the
device the per-token transitions compose with one associative scan (function composition), so
every token knows the state it is read in, with no host work and no Python loop.

A token's text is the text it adds after another token (`token_texts`): what it contributes to a
decoded response, whatever its neighbours, for the decoders that concatenate their tokens'
texts (byte-level BPE: SmolLM2, GPT-2, Llama 3, Qwen; word-level and sentencepiece ones, except
for the one space such a decoder strips from the start of a whole text). Delimiters are ASCII:
UTF-8 never uses an ASCII byte inside a multi-byte character, so a character that byte-level
tokens split (a U+FFFD in each part's text) never hides or fakes a delimiter, and the rule reads
exactly the occurrences the decoded text holds.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

# A newline, or a sentence end (the punctuation, then a space).
DEFAULT_DELIMITERS = ("\n", ". ", "? ", "! ")


def delimiters_problem(delimiters) -> str | None:
    """One line saying why `delimiters` cannot cut steps, or None: a non-empty tuple of
    non-empty ASCII strings."""
    if isinstance(delimiters, str) or not isinstance(delimiters, (tuple, list)) or not delimiters:
        return "must be a non-empty tuple of strings, e.g. ('\\n', '. ')"
    for d in delimiters:
        if not isinstance(d, str) or not d:
            return f"{d!r} is not a non-empty string"
        if not d.isascii():
            return (f"{d!r} is not ASCII (a character of several bytes can be split over "
                    "byte-level tokens)")
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class StepTable:
    """The step rule's tables for one vocabulary and one set of delimiters.

    `transitions [V, S]` int32: the automaton's state after a token's text, read backwards from
    state s; `hits [V, S]` bool: whether a delimiter's first character lies in that text, read
    from state s. State 0 is the automaton's start. Equal (and hashed alike) when their
    delimiters and tables are, so a `PPOStatic` holding one stays a static argument.
    """

    delimiters: tuple
    transitions: np.ndarray
    hits: np.ndarray
    digest: str

    def __eq__(self, other):
        return isinstance(other, StepTable) and (self.delimiters, self.digest) == (
            other.delimiters, other.digest)

    def __hash__(self):
        return hash((self.delimiters, self.digest))


def token_texts(tokenizer) -> list[str]:
    """Every vocabulary entry's text as it appears in a decoded response: what it adds after an
    ordinary token (a special token adds nothing: responses are decoded without them)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not (hasattr(backend, "decode_batch") and hasattr(backend, "get_vocab_size")):
        raise ValueError("the step termination reads a fast (Rust `tokenizers`-backed) "
                         f"tokenizer's texts, got {type(tokenizer).__name__}")
    size = backend.get_vocab_size(with_added_tokens=True)
    alone = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
    anchor = next((i for i, text in enumerate(alone) if text.strip()), None)
    if anchor is None:
        raise ValueError("the tokenizer decodes no token to text")
    prefix = alone[anchor]
    texts = backend.decode_batch([[anchor, i] for i in range(size)], skip_special_tokens=True)
    if any(not t.startswith(prefix) for t in texts):
        raise ValueError("the step termination needs a tokenizer whose decoding concatenates "
                         "its tokens' texts")
    return [t[len(prefix):] for t in texts]


def step_table(tokenizer, delimiters=DEFAULT_DELIMITERS) -> StepTable:
    """The tables of `delimiters` over `tokenizer`'s vocabulary."""
    return table_of_texts(token_texts(tokenizer), delimiters)


def table_of_texts(texts, delimiters) -> StepTable:
    """The tables of `delimiters` over the token texts `texts` (id -> text)."""
    problem = delimiters_problem(delimiters)
    if problem:
        raise ValueError(f"step delimiters {delimiters!r}: {problem}")
    delimiters = tuple(delimiters)
    step, found = _automaton(delimiters)
    alphabet = {c for d in delimiters for c in d}
    width = len(found)
    transitions = np.zeros((len(texts), width), np.int32)
    hits = np.zeros((len(texts), width), bool)
    for i, text in enumerate(texts):
        if not text:
            transitions[i] = np.arange(width)  # no text: the state passes through
            continue
        backwards = text[::-1]
        # A character outside every delimiter sends every state to the start: only the
        # characters before the first such one depend on the state the token is read in.
        cut = next((k for k, c in enumerate(backwards) if c not in alphabet), len(backwards))
        tail_state, tail_hit = _read(step, found, 0, backwards[cut:])
        for s in range(width):
            state, hit = _read(step, found, s, backwards[:cut])
            if cut < len(backwards):
                state, hit = tail_state, hit or tail_hit
            transitions[i, s], hits[i, s] = state, hit
    digest = hashlib.sha256(transitions.tobytes() + hits.tobytes()).hexdigest()
    return StepTable(delimiters, transitions, hits, digest)


def _automaton(delimiters):
    """The automaton over the reversed delimiters: `(step, found)`, `step(state, char) -> state`
    and `found[state]`, whether a reversed delimiter ends in that state. A state is the longest
    suffix of the text read that starts some reversed delimiter (state 0: none)."""
    patterns = {d[::-1] for d in delimiters}
    prefixes = sorted({p[:k] for p in patterns for k in range(len(p) + 1)}, key=lambda s: (
        len(s), s))
    index = {s: i for i, s in enumerate(prefixes)}
    found = [any(s.endswith(p) for p in patterns) for s in prefixes]
    memo = {}

    def step(state, char):
        if (state, char) not in memo:
            read = prefixes[state] + char
            memo[state, char] = next(index[read[k:]] for k in range(len(read) + 1)
                                     if read[k:] in index)
        return memo[state, char]

    return step, found


def _read(step, found, state, text):
    """(state after `text`, whether a match ended on one of its characters)."""
    hit = False
    for char in text:
        state = step(state, char)
        hit = hit or found[state]
    return state, hit
