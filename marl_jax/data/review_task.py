"""The review task (`marl_jax.data.reviews`) as `TaskData`: chat-formatted, tokenised prompts.

The task ships prompts only. Its SFT demonstrations and preference pairs are responses of the
initial (instruct) model to their own prompts, picked and labelled by the gold: the pipeline
samples `samples_per_prompt` responses to each prompt of `TaskData.sampled_prompts` and builds
the SFT set (best of k) and the pairs (`marl_jax.train.sampled_data`). Prompt parts, cut from one
seeded permutation of the 11,200 specs (`reviews.review_prompts`), in this order:

    eval (num_eval_prompts)  held-out prompts of every evaluation and of the final rows
    rm_eval (num_rm_eval)    held-out pairs: the reward model's agreement with the gold
    sft (num_sft)            best-of-k demonstrations
    rm (num_pairs)           the reward model's training pairs
    rl (num_rl_prompts)      PPO prompts

Every record (`ReviewSpec.record()` plus the formatted `prompt` and the `raw_prompt`) rides in
`TaskData.info["records"][part]`, in the order of the arrays, so the gold of a response is
`ReviewGold().score(records, texts)` on its part's records.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from marl_jax.data import collate, reviews
from marl_jax.data.chat import format_records
from marl_jax.data.real_tasks import load_task_tokenizer
from marl_jax.data.task_data import TaskData
from marl_jax.data.task_registry import register_task

PARTS = ("eval", "rm_eval", "sft", "rm", "rl")
SAMPLED_PARTS = ("rm_eval", "sft", "rm")
# part -> the config.task field of its size.
SIZE_FIELDS = {"eval": "num_eval_prompts", "rm_eval": "num_rm_eval", "sft": "num_sft",
               "rm": "num_pairs", "rl": "num_rl_prompts"}
STATS_FILE = "task_stats.json"


def check_config(config) -> None:
    t = config.task
    for part, field in SIZE_FIELDS.items():
        value = t.get(field, None)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.task.{field}={value!r}: the review task's {part!r} part "
                             "needs an int >= 1 prompts")
    k = t.get("samples_per_prompt", None)
    if not isinstance(k, int) or k < 2:
        raise ValueError(f"config.task.samples_per_prompt={k!r}: best-of-k and the preference "
                         "pairs need an int >= 2")
    if not isinstance(t.max_prompt_length, int) or t.max_prompt_length < 1:
        raise ValueError(f"config.task.max_prompt_length={t.max_prompt_length!r}: must be >= 1")


@register_task("reviews")
def build_review_task(config, workdir: str, *, tokenizer=None) -> TaskData:
    """The review task's prompts, formatted with the tokenizer's chat template (when
    `config.task.use_chat_template`) and left-padded to `config.task.max_prompt_length`.

    Raises ValueError when a formatted prompt is longer than that (nothing is dropped: the parts
    keep their sizes and their order).
    """
    check_config(config)
    t = config.task
    if tokenizer is None:
        tokenizer = load_task_tokenizer(config)
    sizes = {part: int(t[SIZE_FIELDS[part]]) for part in PARTS}
    parts = reviews.review_prompts(int(t.data_seed), sizes)
    length = int(t.max_prompt_length)
    records, arrays = {}, {}
    for part, rows in parts.items():
        rows = [dict(r, raw_prompt=r["prompt"]) for r in rows]
        rows = list(format_records(rows, tokenizer, bool(t.use_chat_template)))
        longest = max(len(x) for x in tokenizer([r["prompt"] for r in rows],
                                                add_special_tokens=False)["input_ids"])
        if longest > length:
            raise ValueError(f"config.task.max_prompt_length={length}: the review task's "
                             f"{part!r} prompts need up to {longest} tokens as formatted; raise it")
        ids, mask = collate.encode_prompts(tokenizer, [r["prompt"] for r in rows], length)
        records[part], arrays[part] = rows, dict(ids=ids, mask=mask)
    _write_stats(workdir, sizes)
    response_length = int(config.ppo.response_length)
    empty_sft, empty_rm = _empty_supervised(length, response_length)
    return TaskData(
        tokenizer=tokenizer, prompt_length=length, response_length=response_length,
        sft=empty_sft, rm=empty_rm, rl=arrays["rl"], eval=arrays["eval"],
        sampled_prompts={part: arrays[part] for part in SAMPLED_PARTS},
        info=dict(task="reviews", counts=sizes, records=records,
                  eval_records=records["eval"]))


def _empty_supervised(prompt_length: int, response_length: int):
    """Empty SFT and pair arrays: the pipeline fills them from the model's samples."""
    def zeros(width):
        return np.zeros((0, width), np.int32)

    sft = dict(prompt_ids=zeros(prompt_length), prompt_mask=zeros(prompt_length),
               response_ids=zeros(response_length), response_mask=zeros(response_length))
    rm = dict(prompt_ids=zeros(prompt_length), prompt_mask=zeros(prompt_length),
              chosen_ids=zeros(response_length), chosen_mask=zeros(response_length),
              rejected_ids=zeros(response_length), rejected_mask=zeros(response_length))
    return sft, rm


def _write_stats(workdir: str, sizes: dict) -> None:
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, STATS_FILE), "w") as f:
            json.dump(dict(task="reviews", counts=sizes), f, indent=2)
