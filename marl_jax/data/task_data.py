"""`TaskData`: the arrays of one task that every stage uses, and the SFT / RM arrays of records."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass
class TaskData:
    tokenizer: Any
    prompt_length: int
    response_length: int
    # SFT: prompts [N, P] (left-padded) and demonstrations [N, R] (left-aligned, EOS included).
    sft: dict
    # RM: prompts [M, P], chosen [M, R], rejected [M, R] (+ masks); None for a task whose
    # reward is its environment's (a multi-turn task: no reward model).
    rm: Optional[dict]
    # PPO prompts [K, P] and held-out evaluation prompts [E, P].
    rl: dict
    eval: dict
    # Gold reward for the synthetic task: gold_fn(documents [B, D], ids [B, R], mask [B, R]) -> [B]
    # (jittable); documents ride along in rl["documents"] / eval["documents"].
    gold_fn: Optional[Callable] = None
    # A host-side reward for `config.ppo.reward_source="host"`, handed to the task by its caller
    # (the APPS unit tests of `rl_unit_tests`, `marl_jax.eval.unit_test_reward`):
    # host_reward(rl_rows [B], response_ids [B, R], response_mask [B, R]) -> [B] float.
    host_reward: Optional[Callable] = None
    # The unit tests of each RL prompt (APPS: its `input_output` JSON), in `rl` order.
    rl_unit_tests: Optional[list] = None
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
    # whose gold runs on the host: eval_gold(texts [E]) -> [E] float, in `eval` order, or
    # eval_gold(texts [N], rows=[N]) for responses to the held-out prompts `rows`.
    eval_gold: Optional[Callable] = None
    # A multi-turn task's environment: {"name", "kwargs"}, what
    # `marl_jax.envs.environment(name, **kwargs)` builds; its task rows of the `rl` / `eval`
    # prompts are `info["rl_rows"]` / `info["eval_rows"]`, in the order of the arrays. With it,
    # `sft` also holds `action_mask` [N, R] (1 on the policy's tokens, 0 on observations) and
    # `turn_ids` [N, R], and R is the trajectory's budget (actions and observations).
    environment: Optional[dict] = None
    # How the trainer plays a multi-turn task (set with `environment`): turn_callback(task rows
    # [B], episode seeds [B]) -> the host callback `rollout.turns.run_turns` steps the episodes
    # of those rows with; end_of_turn: the token ids that end an assistant turn.
    turn_callback: Optional[Callable] = None
    end_of_turn: tuple = ()
    info: dict = dataclasses.field(default_factory=dict)


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
