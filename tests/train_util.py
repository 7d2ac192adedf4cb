"""A tiny synthetic pipeline config that trains in seconds (shared by the training tests)."""
import pathlib
import sys

import ml_collections

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from configs import synthetic  # noqa: E402
from marl_jax.config import set_field  # noqa: E402


def tiny_config(**overrides):
    c = synthetic.get_config()
    c.stage = "all"
    c.task.update(dict(num_entities=8, num_words=8, doc_size=4, summary_items=2,
                       min_description=2, max_description=3, num_sft=512, num_pairs=512,
                       num_rl_prompts=512, num_eval_prompts=16))
    c.model.config.update(dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                               num_kv_heads=2, head_dim=16, max_position_embeddings=64))
    c.sft.update(dict(steps=4, batch_size=16))
    c.rm.update(dict(steps=4, batch_size=16))
    c.ppo.update(dict(steps=2, batch_size=8, response_length=12, eval_every=2))
    c.checkpoint_every = 2
    c.seeds = (0, 1)
    for dotted, value in overrides.items():
        set_field(c, dotted, value)
    return c


def _flat(config, prefix=""):
    out = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def tiny_flags(**overrides):
    """`--config.x=v` flags turning configs/synthetic.py into `tiny_config(**overrides)`
    (tuple fields, which a flag spells differently, excepted)."""
    base, tiny = _flat(synthetic.get_config()), _flat(tiny_config(**overrides))
    flags = [f"--config.{key}={value}" for key, value in sorted(tiny.items())
             if base.get(key) != value and not isinstance(value, tuple)]
    return [f"--config={ROOT / 'configs' / 'synthetic.py'}"] + flags


def trained_tiny_pipeline(workdir):
    """(pipeline, SFT params, RM params, reward statistics) of `tiny_config()` trained in
    `workdir`; a generator for module-scoped fixtures (the pipeline is closed after)."""
    from marl_jax import pipeline as pipeline_lib

    pipe = pipeline_lib.Pipeline(tiny_config(), str(workdir))
    sft = pipe.sft()
    rm, stats = pipe.rm()
    yield pipe, sft, rm, stats
    pipe.close()


def ppo_setup(tiny_pipe, **fields):
    """(config, static, models, state, frozen) of a PPO run of `tiny_config` with `ppo` fields
    `fields`, started from a `trained_tiny_pipeline` (validated first)."""
    import jax
    import jax.numpy as jnp

    from marl_jax.config_check import validate_config
    from marl_jax.train import ppo as ppo_lib, ppo_types

    pipe, sft, rm, stats = tiny_pipe
    cfg = tiny_config(**{f"ppo.{k}": v for k, v in fields.items()})
    validate_config(cfg)
    static = ppo_lib.static_from_config(cfg, pipe.task.tokenizer)
    mods = ppo_lib.make_models(cfg, pipe.policy, pipe.critic, pipe.reward_model, pipe.task.gold_fn)
    critic = ppo_lib.initial_critic_params(cfg, pipe.critic, sft, rm, jax.random.key(0), stats)
    state = ppo_lib.initial_state(cfg, mods, sft, critic, seed=0)
    frozen = ppo_types.Frozen(sft, rm, jnp.float32(stats["mean"]), jnp.float32(stats["std"]))
    return cfg, static, mods, state, frozen
