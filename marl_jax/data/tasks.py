"""The data of one RLHF pipeline, tokenised into the arrays every stage uses.

`build_task(config, workdir)` returns a `TaskData` for the synthetic task, a real dataset (tldr,
hh_rlhf, webgpt, apps) or the review task (reviews): SFT demonstrations, preference pairs, RL
prompts and held-out evaluation prompts, plus, for the synthetic task, the gold reward.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Optional

import numpy as np

from marl_jax.data import collate
from marl_jax.data import synthetic as syn


@dataclasses.dataclass
class TaskData:
    tokenizer: Any
    prompt_length: int
    response_length: int
    # SFT: prompts [N, P] (left-padded) and demonstrations [N, R] (left-aligned, EOS included).
    sft: dict
    # RM: prompts [M, P], chosen [M, R], rejected [M, R] (+ masks).
    rm: dict
    # PPO prompts [K, P] and held-out evaluation prompts [E, P].
    rl: dict
    eval: dict
    # Gold reward for the synthetic task: gold_fn(documents [B, D], ids [B, R], mask [B, R]) -> [B]
    # (jittable); documents ride along in rl["documents"] / eval["documents"].
    gold_fn: Optional[Callable] = None
    # A host-side reward for `config.ppo.reward_source="host"`:
    # host_reward(rl_rows [B], response_ids [B, R], response_mask [B, R]) -> [B] float.
    host_reward: Optional[Callable] = None
    # Prompts [K, P] (with documents) whose preference pairs are sampled from the SFT policy
    # before the reward model trains, and the annotator that labels them:
    # label_pairs(documents [K, D], ids_a, mask_a, ids_b, mask_b [K, R]) -> [K] bool (a wins).
    policy_pair_prompts: Optional[dict] = None
    label_pairs: Optional[Callable] = None
    # Prompts `{"ids", "mask"}` [N, P] per part whose responses are sampled from the initial
    # model to make the SFT set and the preference pairs (the review task; see
    # `marl_jax.data.review_task`); their records are in `info["records"][part]`.
    sampled_prompts: Optional[dict] = None
    # The gold of decoded responses to the held-out prompts, attached by the pipeline for tasks
    # whose gold runs on the host: eval_gold(texts [E]) -> [E] float, in `eval` order.
    eval_gold: Optional[Callable] = None
    info: dict = dataclasses.field(default_factory=dict)


def synthetic_task_from_config(cfg) -> syn.SyntheticTask:
    fields = {f.name for f in dataclasses.fields(syn.SyntheticTask)}
    kwargs = {k: v for k, v in cfg.items() if k in fields}
    return syn.SyntheticTask(**kwargs)


def build_task(config, workdir: str) -> TaskData:
    """The task named by `config.task.name`, tokenised; deterministic in `config.task`."""
    name = config.task.name
    if name == "synthetic":
        return _synthetic(config, workdir)
    if name == "reviews":
        from marl_jax.data.review_task import build_review_task
        return build_review_task(config, workdir)
    from marl_jax.data import real_tasks
    return real_tasks.build_real_task(config, workdir)


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


def supervised_arrays(prompts, responses, sft_rows, pairs) -> tuple[dict, dict]:
    """The `TaskData.sft` and `TaskData.rm` arrays.

    Args:
      prompts: rows -> dict with `ids` / `mask` `[N, P]` of their "prompt" fields.
      responses: texts -> (ids, mask) `[N, R]`.
      sft_rows: rows with "prompt" and "response"; pairs: rows with "prompt", "chosen" and
        "rejected".
    """
    sft_prompts, rm_prompts = prompts(sft_rows), prompts(pairs)
    sft_ids, sft_mask = responses([x["response"] for x in sft_rows])
    chosen_ids, chosen_mask = responses([x["chosen"] for x in pairs])
    rejected_ids, rejected_mask = responses([x["rejected"] for x in pairs])
    sft = dict(prompt_ids=sft_prompts["ids"], prompt_mask=sft_prompts["mask"],
               response_ids=sft_ids, response_mask=sft_mask)
    rm = dict(prompt_ids=rm_prompts["ids"], prompt_mask=rm_prompts["mask"],
              chosen_ids=chosen_ids, chosen_mask=chosen_mask,
              rejected_ids=rejected_ids, rejected_mask=rejected_mask)
    return sft, rm
