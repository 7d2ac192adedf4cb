"""OpenAI WebGPT comparisons: openai/webgpt_comparisons.

Rows: `{question: {dataset, id, full_text}, quotes_0, answer_0, tokens_0, score_0, quotes_1,
answer_1, tokens_1, score_1}`. The answer with the higher score is chosen; ties (equal scores)
are dropped. Quotes are not used, so numeric citation markers such
as "[1]" or "[2, 3]" are removed from the answers (DeepSpeed-Chat, which the official MA-RLHF code
builds on, removes every bracketed or parenthesised span instead; only citations are removed
here). Prompts use the DeepSpeed-Chat layout " Human: {question} Assistant:", answers become
" {answer}". The hub copy has a train split only: use `paper_split` to hold rows out.
"""
import math
import re

from marl_jax.data.records import BadRow, DroppedRow, field, text_field

PROMPT_FORMAT = " Human: {question} Assistant:"
_CITATION = re.compile(r"\s*\[\d+(?:\s*[,\-\u2013]\s*\d+)*\]")


def answer_text(answer):
    """An answer as a completion: citation markers removed, stripped, one leading space."""
    return " " + _CITATION.sub("", answer).strip()


def prompt(row):
    return PROMPT_FORMAT.format(question=text_field(row, "question.full_text").strip())


def _score(row, name):
    value = field(row, name)
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise BadRow(f"non-numeric {name}") from None
    if math.isnan(score):
        raise BadRow(f"non-numeric {name}")
    return score


def preference_pair(row):
    scores = _score(row, "score_0"), _score(row, "score_1")
    if scores[0] == scores[1]:
        raise DroppedRow("tie (score_0 == score_1)")
    better = 0 if scores[0] > scores[1] else 1
    answers = [answer_text(text_field(row, f"answer_{i}")) for i in (0, 1)]
    if not answers[0].strip() or not answers[1].strip():
        raise BadRow("answer empty after removing citations")
    return {"prompt": prompt(row), "chosen": answers[better], "rejected": answers[1 - better],
            "id": field(row, "question.id")}


def prompt_record(row):
    return {"prompt": prompt(row), "id": field(row, "question.id")}


def sft_example(row):
    pair = preference_pair(row)
    return {"prompt": pair["prompt"], "response": pair["chosen"], "id": pair["id"]}
