"""The default experiment: MA-PPO against token PPO and its matched control, offline, on the
synthetic summarisation task (marl_jax/data/synthetic.py) with ~96-token responses.

    python experiments/run.py                      # this file, stage "experiment"
    python experiments/run.py --config.stage=all   # one SFT -> RM -> PPO pipeline (config.ppo)

Sizes are chosen so that SFT, the reward model and 4 arms x 3 seeds of PPO finish within
minutes on a 2-core CPU; PPO hyper-parameters other than the learning rates and batch size are
the paper's (MA-PPO as released: fixed 5-gram macros, `equal` weighting, `weighted` rewards).
"""
import ml_collections

from marl_jax.config import base_config


def get_config():
    c = base_config()
    c.stage = "experiment"
    c.seed = 0
    c.seeds = (0, 1, 2)
    c.checkpoint_every = 50
    c.log_every = 1

    c.task = ml_collections.ConfigDict(dict(
        name="synthetic",
        path="",
        data_seed=0,
        num_sft=4096,
        num_pairs=4096,
        num_rl_prompts=8192,
        num_eval_prompts=64,
        # The world (see SyntheticTask).
        num_entities=16,
        num_words=16,
        doc_size=10,
        summary_items=8,
        min_description=8,
        max_description=12,
        world_seed=1234,
        demo_substitute=0.25,
        demo_swap=0.25,
        annotator_temperature=0.05,
    ))

    c.model.config = ml_collections.ConfigDict(dict(
        family="llama",
        hidden_size=64,
        intermediate_size=192,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        norm_eps=1e-5,
    ))

    c.sft.steps = 300
    c.sft.batch_size = 32
    c.sft.learning_rate = 3e-3
    c.sft.schedule = "cosine"
    c.sft.weight_decay = 0.0

    c.rm.steps = 250
    c.rm.batch_size = 32
    c.rm.learning_rate = 1e-3
    c.rm.schedule = "cosine"
    c.rm.weight_decay = 0.0

    p = c.ppo
    p.steps = 120
    p.batch_size = 16
    p.learning_rate = 2e-4
    p.critic_learning_rate = 1e-3
    p.schedule = "constant"
    p.warmup_ratio = 0.0
    p.weight_decay = 0.0
    p.response_length = 120
    # The vocabulary has a few dozen tokens: top-k 50 would filter nothing.
    p.top_k = 0
    p.eval_every = 10

    c.experiment = ml_collections.ConfigDict(dict(
        arms=("ppo", "ma_ppo", "ppo_matched", "ma_ppo_smdp"),
        smoothing=3,  # trailing moving average over eval points, for step counts
        horizons=(),  # summary_items values to repeat the experiment at (each in its own dir)
    ))
    return c
