"""APPS (codeparrot/apps): programming problems with unit tests.

Rows: `{problem_id, question, solutions, input_output, difficulty, url, starter_code}` where
`solutions` is a JSON list of Python programs and `input_output` a JSON object
`{"inputs": [...], "outputs": [...], "fn_name"?: str}`.

The prompt follows the APPS paper's generation script (`generate_gpt_codes.py`):

    "\\nQUESTION:\\n" + question + ("\\n" + starter_code if starter_code) +
    ("\\nUse Call-Based format" if fn_name else "\\nUse Standard Input format") + "\\nANSWER:\\n"

Prompt records carry the parsed tests (`input_output`), `fn_name` (None for standard-input
problems), `difficulty`, `problem_id`, `starter_code` and `url`; SFT examples answer with the first
solution. Rows whose `input_output` is empty, not JSON or without matching input/output lists are
skipped, since neither the prompt format nor the reward can be decided without it. There are no
preference pairs.
"""
import json

from marl_jax.data.records import BadRow, DroppedRow, field, text_field

DIFFICULTIES = ("introductory", "interview", "competition")


def parse_input_output(row):
    """The unit tests of a row as a dict with equal-length `inputs` and `outputs` lists."""
    raw = field(row, "input_output")
    if not isinstance(raw, str) or not raw.strip():
        raise BadRow("empty input_output")
    try:
        tests = json.loads(raw)
    except json.JSONDecodeError:
        raise BadRow("input_output is not valid JSON") from None
    if not isinstance(tests, dict):
        raise BadRow("input_output is not a JSON object")
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise BadRow("input_output lacks equal-length inputs and outputs lists")
    return tests


def format_prompt(question, starter_code, fn_name):
    text = "\nQUESTION:\n" + question
    if starter_code:
        text += "\n" + starter_code
    text += "\nUse Call-Based format" if fn_name else "\nUse Standard Input format"
    return text + "\nANSWER:\n"


def prompt_record(row, *, difficulties=None):
    difficulty = row.get("difficulty")
    if difficulties is not None and difficulty not in difficulties:
        raise DroppedRow(f"difficulty not in {tuple(difficulties)}")
    question = text_field(row, "question")
    tests = parse_input_output(row)
    fn_name = tests.get("fn_name") or None
    starter_code = row.get("starter_code") or ""
    return {
        "prompt": format_prompt(question, starter_code, fn_name),
        "input_output": tests,
        "fn_name": fn_name,
        "difficulty": difficulty,
        "problem_id": row.get("problem_id"),
        "starter_code": starter_code,
        "url": row.get("url"),
    }


def first_solution(row):
    raw = field(row, "solutions")
    if not isinstance(raw, str) or not raw.strip():
        raise BadRow("empty solutions")
    try:
        solutions = json.loads(raw)
    except json.JSONDecodeError:
        raise BadRow("solutions is not valid JSON") from None
    if not isinstance(solutions, list) or not solutions:
        raise BadRow("solutions is not a non-empty JSON list")
    solution = solutions[0]
    if not isinstance(solution, str) or not solution.strip():
        raise BadRow("empty first solution")
    return solution


def sft_example(row, *, difficulties=None):
    record = prompt_record(row, difficulties=difficulties)
    return {"prompt": record["prompt"], "response": first_solution(row),
            "problem_id": record["problem_id"], "difficulty": record["difficulty"]}
