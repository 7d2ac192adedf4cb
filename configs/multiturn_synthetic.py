"""Multi-turn RLHF on the calculator task (marl_jax/envs/calculator.py): arithmetic word problems
solved in turns, each turn a calculator call or the answer, the tool's value coming back as the
next observation; the reward is the environment's (1 for the gold answer, else 0), so there is
no reward model.

    python experiments/run.py --config=configs/multiturn_synthetic.py

runs the study of docs/multiturn.md: SFT once, then token PPO, turn-level MA-PPO
(`ma_ppo_turn`), MA-PPO with fixed n-grams inside turns (`ma_ppo`), each macro arm's matched
token-PPO control (lam^(1/L), L measured on the arm's first trajectories), GRPO on the
trajectory and the per-turn leave-one-out (`turn_rloo`), over seeds 0-3 (the second seed set:
`--config.seeds="(4,5,6,7)"`), each arm and seed a run of one vmapped program per group.
`--config.stage=all` trains one run (SFT, then PPO with `ppo`'s settings).

SFT trains on demonstrations of tool use (one call per operation, then the answer: three
assistant turns, 29 tokens of actions and observations; half of them stop after the first call
and answer its value, `task.demo_shortcut`) on the action tokens only: the SFT policy stops too
soon in about half of its episodes and solves about a quarter of them (sampled), which leaves
PPO a decision at the start of a turn to learn. PPO plays the
environment from the first prompts of fresh problems within a trajectory budget of
`ppo.response_length` tokens (actions and observations) and `task.max_turns` turns.
"""
import ml_collections

from marl_jax.config import base_config


def get_config():
    c = base_config()
    c.stage = "experiment"
    c.seed = 0
    c.seeds = (0, 1, 2, 3)
    c.checkpoint_every = 50
    c.log_every = 1

    c.task = ml_collections.ConfigDict(dict(
        name="calculator",
        path="",
        data_seed=0,
        num_sft=2048,
        num_rl_prompts=4096,
        num_eval_prompts=128,
        # The first prompt (chat template and generation prompt) of the longest story.
        prompt_length=32,
        max_turns=4,
        # A turn's tokens: an action ("calc ( 20 + 72 )" and the end of turn: 7) and an
        # observation span ("<|im_start|> tool error: bad expression <|im_end|> <|im_start|>
        # assistant": 7).
        max_turn_tokens=10,
        max_observation_tokens=8,
        # The problems (see CalculatorTask): a in [min_a, max_a], b and c in [2, max_bc],
        # numbers written as words up to max_value (the largest value is (max_a + max_bc) *
        # max_bc = 261).
        min_a=10,
        max_a=20,
        max_bc=9,
        max_value=299,
        # Half the demonstrations stop after the first tool call and answer its value (wrong):
        # the SFT policy often stops too soon, a decision at the start of a turn for PPO to fix.
        demo_shortcut=0.5,
        # The task's own word-level tokenizer; "model" (the checkpoint's) or a tokenizer's path
        # plays the same environment in another chat template (configs/multiturn_smollm2.py).
        tokenizer="word",
    ))

    c.model.config = ml_collections.ConfigDict(dict(
        family="llama",
        # Wide enough to learn to copy numbers from the problem and the tool's answers.
        hidden_size=64,
        intermediate_size=192,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        max_position_embeddings=128,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        norm_eps=1e-5,
    ))

    c.sft.steps = 600
    c.sft.batch_size = 32
    c.sft.learning_rate = 3e-3
    c.sft.schedule = "cosine"
    c.sft.weight_decay = 0.0

    # The environment's answer check is the reward: no reward model to train.
    c.rm.steps = 0
    c.rm.batch_size = 32
    c.rm.learning_rate = 1e-3
    c.rm.schedule = "cosine"
    c.rm.weight_decay = 0.0

    p = c.ppo
    p.steps = 40
    p.batch_size = 16
    p.learning_rate = 2e-4
    p.critic_learning_rate = 1e-3
    p.schedule = "constant"
    p.warmup_ratio = 0.0
    p.weight_decay = 0.0
    # The environment's rewards; the critic starts from the SFT policy (no reward model).
    p.reward_source = "env"
    p.critic_init = "sft"
    # The trajectory budget: max_turns turns of max_turn_tokens + max_observation_tokens.
    p.response_length = 72
    # The vocabulary has a few hundred words, most of them numbers.
    p.top_k = 0
    p.eval_every = 10

    c.experiment = ml_collections.ConfigDict(dict(
        # Token PPO, turn-level MA-PPO, MA-PPO with fixed n-grams inside turns (each with its
        # matched token-PPO control), GRPO on the trajectory and the per-turn leave-one-out.
        arms=("ppo", "ma_ppo_turn", "ma_ppo", "grpo", "turn_rloo"),
        add_controls=True,
        controls=ml_collections.ConfigDict(),
        smoothing=1,
        horizons=(),
        runs_per_program=0,
    ))
    # The critic-free arms compare the k samples of a prompt (16 rows: 4 prompts x 4 samples).
    p.arm_overrides = ml_collections.ConfigDict(dict(grpo=dict(group_size=4),
                                                     turn_rloo=dict(group_size=4)))
    return c
