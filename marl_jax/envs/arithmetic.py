"""Exact integer arithmetic from text, without `eval`: the calculator environment's tool.

The grammar, and nothing else (whitespace is allowed between tokens):

    expression := term (("+" | "-") term)*
    term       := factor ("*" factor)*
    factor     := digits | "(" expression ")" | "-" factor

Values are Python ints (exact). Text longer than `MAX_CHARS` or nested deeper than `MAX_DEPTH`
is refused, which bounds the work a policy's expression can ask for (with no power operator
and at most MAX_CHARS / 2 factors, a product stays a few hundred digits long).
"""
from __future__ import annotations

import re

MAX_CHARS = 256
MAX_DEPTH = 32
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*()]))")


class ExpressionError(ValueError):
    """Text that is not an expression of the grammar."""


def tokenize_expression(text: str) -> list:
    """The tokens of `text`: ints and the characters + - * ( ). ExpressionError on anything else."""
    if not isinstance(text, str):
        raise ExpressionError(f"an expression must be a str, got {type(text).__name__}")
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"expression longer than {MAX_CHARS} characters")
    tokens, at = [], 0
    stripped_end = len(text.rstrip())
    while at < stripped_end:
        match = _TOKEN.match(text, at)
        if match is None:
            rest = text[at:].lstrip()
            raise ExpressionError(f"unexpected character {rest[0]!r} at {len(text) - len(rest)}")
        number, symbol = match.groups()
        tokens.append(int(number) if number is not None else symbol)
        at = match.end()
    return tokens


def evaluate(text: str) -> int:
    """The exact value of the expression `text`; ExpressionError naming the problem otherwise."""
    tokens = tokenize_expression(text)
    if not tokens:
        raise ExpressionError("empty expression")
    value, at = _expression(tokens, 0, 0)
    if at != len(tokens):
        raise ExpressionError(f"unexpected {tokens[at]!r} after a complete expression")
    return value


def _expression(tokens, at, depth):
    value, at = _term(tokens, at, depth)
    while at < len(tokens) and tokens[at] in ("+", "-"):
        operator = tokens[at]
        right, at = _term(tokens, at + 1, depth)
        value = value + right if operator == "+" else value - right
    return value, at


def _term(tokens, at, depth):
    value, at = _factor(tokens, at, depth)
    while at < len(tokens) and tokens[at] == "*":
        right, at = _factor(tokens, at + 1, depth)
        value *= right
    return value, at


def _factor(tokens, at, depth):
    if depth > MAX_DEPTH:
        raise ExpressionError(f"expression nested deeper than {MAX_DEPTH}")
    if at >= len(tokens):
        raise ExpressionError("expression ends where a number or '(' was expected")
    token = tokens[at]
    if isinstance(token, int):
        return token, at + 1
    if token == "-":
        value, at = _factor(tokens, at + 1, depth + 1)
        return -value, at
    if token == "(":
        value, at = _expression(tokens, at + 1, depth + 1)
        if at >= len(tokens) or tokens[at] != ")":
            raise ExpressionError("unclosed '('")
        return value, at + 1
    raise ExpressionError(f"unexpected {token!r} where a number or '(' was expected")
