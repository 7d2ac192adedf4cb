"""Fixture rows in the public schema of each real dataset, and writers for jsonl / parquet files.

Each `*_rows()` returns well-formed rows and deliberately broken ones (missing fields, empty text,
bad JSON); the tests state which records they expect from them.
"""
import json
import pathlib

import datasets


def _tldr_row(post_id, post, title, subreddit, texts, choice, batch="batch10"):
    return {
        "info": {"id": post_id, "post": post, "title": title, "subreddit": subreddit,
                 "site": None, "article": None},
        "summaries": [{"text": text, "policy": "sup2", "note": None} for text in texts],
        "choice": choice,
        "worker": "w1",
        "batch": batch,
        "split": "train",
        "extra": {"confidence": 7},
    }


def tldr_rows():
    cnndm = _tldr_row("c1", None, "Storm hits coast", None, [" A storm.", " Rain."], 0,
                      batch="cnndm0")
    cnndm["info"]["article"] = "A storm hit the coast on Monday."
    return [
        _tldr_row("t3_a", "My cat ignores me.\nWhat do I do?", "Cat trouble", "pets",
                  [" cat ignores me", " I have a cat\n"], 0),
        _tldr_row("t3_b", "I lost my keys twice.", "Keys", "self",
                  [" keys lost", "lost my keys twice, need advice"], 1),
        _tldr_row("t3_c", None, "No post", "self", [" a", " b"], 0),          # missing post
        _tldr_row("t3_d", "Body", "Empty summary", "self", [" fine", "   "], 1),  # empty text
        cnndm,                                                                # CNN/DM batch
        _tldr_row("t3_a", "My cat ignores me.\nWhat do I do?", "Cat trouble", "pets",
                  [" my cat is aloof", " cat ignores me"], 1),              # same post again
    ]


def tldr_sft_rows():
    return [
        {"prompt": "SUBREDDIT: r/pets\nTITLE: Cat\nPOST: My cat.\nTL;DR:", "label": "cat is fine"},
        {"prompt": "SUBREDDIT: r/self\nTITLE: Keys\nPOST: Lost.\nTL;DR:", "label": ""},  # empty
    ]


def hh_rows():
    two_turns = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Name a fruit.\n\nAssistant:"
    return [
        {"prompt": two_turns, "response": " An apple.", "chosen": " An apple.",
         "rejected": " No."},
        {"prompt": "\n\nHuman: Is water wet?\n\nAssistant:", "response": " Yes.",
         "chosen": " Yes.", "rejected": None},                               # missing rejected
        {"prompt": "\n\nHuman: Same?\n\nAssistant:", "response": " Same.", "chosen": " Same.",
         "rejected": " Same."},                                              # no preference
        {"prompt": "", "response": " x", "chosen": " x", "rejected": " y"},  # empty prompt
    ]


def _webgpt_row(qid, question, answer_0, score_0, answer_1, score_1):
    quotes = {"title": ["A page"], "extract": ["Some text."]}
    return {
        "question": {"dataset": "eli5", "id": qid, "full_text": question},
        "quotes_0": quotes, "answer_0": answer_0, "tokens_0": [], "score_0": score_0,
        "quotes_1": quotes, "answer_1": answer_1, "tokens_1": [], "score_1": score_1,
    }


def webgpt_rows():
    return [
        _webgpt_row("q1", "Why is the sky blue?", "Rayleigh scattering [1].", 1.0,
                    "Because it is.", -1.0),
        _webgpt_row("q2", "Why do cats purr?", "Nobody knows.", -0.5,
                    "Purring comes from the larynx [1][2] (mostly).", 0.5),
        _webgpt_row("q3", "Tie?", "Answer A.", 0.0, "Answer B.", 0.0),         # tie
        _webgpt_row("q4", None, "Answer A.", 1.0, "Answer B.", 0.0),           # missing question
    ]


def _apps_row(problem_id, question, solutions, input_output, difficulty, starter_code=""):
    return {
        "problem_id": problem_id, "question": question, "solutions": solutions,
        "input_output": input_output, "difficulty": difficulty,
        "url": f"https://example.org/{problem_id}", "starter_code": starter_code,
    }


def apps_rows():
    return [
        _apps_row(0, "Add two numbers.", json.dumps(["a, b = map(int, input().split())\n"
                                                     "print(a + b)\n", "print(0)\n"]),
                  json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}), "introductory"),
        _apps_row(1, "Return the double of x.", json.dumps(["class Solution:\n    def double"
                                                            "(self, x):\n        return 2 * x\n"]),
                  json.dumps({"fn_name": "double", "inputs": [[1], [2]], "outputs": [2, 4]}),
                  "interview", starter_code="class Solution:\n    def double(self, x):"),
        _apps_row(2, "Broken tests.", json.dumps(["print(1)\n"]), "{not json", "interview"),
        _apps_row(3, "No tests.", json.dumps(["print(1)\n"]), "", "competition"),
        _apps_row(4, "No solutions.", "", json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]}),
                  "competition"),
    ]


def write_jsonl(rows, path):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_parquet(rows, path):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


WRITERS = {"jsonl": write_jsonl, "parquet": write_parquet}
