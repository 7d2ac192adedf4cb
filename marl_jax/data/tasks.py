"""The data of one RLHF pipeline, tokenised into the arrays every stage uses.

`build_task(config, workdir)` returns a `TaskData` for the synthetic task, a real dataset (tldr,
hh_rlhf, webgpt, apps) or the review task (reviews): SFT demonstrations, preference pairs, RL
prompts and held-out evaluation prompts, plus, for the synthetic task, the gold reward. Each task
module registers its builder in `marl_jax.data.task_registry`; this module imports them all.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from marl_jax.data import collate
from marl_jax.data import real_tasks, review_task  # noqa: F401  (they register their tasks)
from marl_jax.data import synthetic as syn
from marl_jax.data.task_data import TaskData, supervised_arrays
from marl_jax.data.task_registry import register_task, task_builder


def synthetic_task_from_config(cfg) -> syn.SyntheticTask:
    fields = {f.name for f in dataclasses.fields(syn.SyntheticTask)}
    kwargs = {k: v for k, v in cfg.items() if k in fields}
    return syn.SyntheticTask(**kwargs)


def build_task(config, workdir: str) -> TaskData:
    """The task named by `config.task.name`, tokenised; deterministic in `config.task`."""
    return task_builder(config.task.name)(config, workdir)


@register_task("synthetic")
def _synthetic(config, workdir: str) -> TaskData:
    t = config.task
    task = synthetic_task_from_config(t)
    tokenizer = syn.build_tokenizer(task, os.path.join(workdir, "tokenizer"))
    p = task.prompt_length
    r = config.ppo.response_length
    if r < task.max_response_length:
        raise ValueError(
            f"config.ppo.response_length={r} is shorter than the longest ideal synthetic "
            f"response ({task.max_response_length} tokens); raise it or shorten the task")
    seed = t.data_seed

    fraction = float(t.get("policy_pairs", 0.0))
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"config.task.policy_pairs={fraction}: must be in [0, 1) (the "
                         "generated pairs carry the failure modes the policy has not shown yet)")
    num_policy_pairs = int(round(fraction * t.num_pairs))
    sft_rows = syn.sft_examples(task, seed, t.num_sft)
    pairs = syn.preference_pairs(task, seed + 1, t.num_pairs - num_policy_pairs)
    rl_rows = syn.rl_prompts(task, seed + 2, t.num_rl_prompts)
    eval_rows = syn.rl_prompts(task, seed + 3, t.num_eval_prompts)
    policy_pair_rows = syn.rl_prompts(task, seed + 4, num_policy_pairs)

    def prompts(rows):
        ids, mask = collate.encode_prompts(tokenizer, [x["prompt"] for x in rows], p)
        return dict(ids=ids, mask=mask, documents=np.stack([x["document"] for x in rows]))

    def responses(texts):
        # Synthetic texts carry their own EOS; the truncated corruptions end without one, like
        # PPO responses cut at response_length, so the reward model learns what gold penalises.
        return collate.encode_responses(tokenizer, texts, r, append_eos=False)

    sft, rm = supervised_arrays(prompts, responses, sft_rows, pairs)
    return TaskData(
        tokenizer=tokenizer, prompt_length=p, response_length=r, sft=sft, rm=rm,
        rl=prompts(rl_rows), eval=prompts(eval_rows),
        gold_fn=functools.partial(syn.gold_score_jax, task),
        policy_pair_prompts=prompts(policy_pair_rows) if num_policy_pairs else None,
        label_pairs=functools.partial(syn.label_sampled_pairs, task, seed + 5),
        info=dict(task=dataclasses.asdict(task)),
    )
