"""MA-PPO vs PPO step time at identical shapes, and tokens/s of each phase.

`python experiments/bench.py step [--batch 16] [--repeats 5] [--config configs/synthetic.py]`

Both arms start from the same parameters and the same key, so their rollouts are identical
token for token; they differ only in termination + macro GAE (MA-PPO: fixed 5-grams, `equal`
weighting, `weighted` rewards; PPO: n = 1). The paper claims macro actions add no compute; the
target is at most 3% overhead on a whole step.
"""
import functools
import tempfile

import jax
import jax.numpy as jnp

from bench_timing import best_time, load_config, step_timing_args



def main(argv):
    args = step_timing_args(argv, prog="bench.py step", doc=__doc__, config="synthetic.py",
                            batch=16, repeats=5)

    from marl_jax.pipeline import Pipeline
    from marl_jax.train import ppo as ppo_lib
    from marl_jax.train import ppo_core as core
    from marl_jax import models

    config = load_config(args.config)
    config.ppo.batch_size = args.batch
    with tempfile.TemporaryDirectory() as workdir:
        pipe = Pipeline(config, workdir)
        policy_params = models.init_params(pipe.policy, jax.random.key(0))
        rm_params = models.init_params(pipe.reward_model, jax.random.key(1))
        ids = jnp.asarray(pipe.task.rl["ids"][:args.batch])
        mask = jnp.asarray(pipe.task.rl["mask"][:args.batch])
        frozen = core.Frozen(policy_params, rm_params, jnp.float32(0), jnp.float32(1))
        arms = {"ppo": (1, ("fixed", "equal", "weighted")),
                "ma_ppo": (config.ppo.ngram, ("fixed", "equal", "weighted"))}
        times = {}
        for name, (n, variant) in arms.items():
            static = ppo_lib.static_from_config(config, pipe.task.tokenizer, variants=(variant,))
            mods = ppo_lib.make_models(config, pipe.policy, pipe.critic, pipe.reward_model)
            critic_params = ppo_lib.initial_critic_params(
                config, pipe.critic, policy_params, rm_params, jax.random.key(2),
                {"mean": 0.0, "std": 1.0})
            state = ppo_lib.initial_state(config, mods, policy_params, critic_params, seed=0)
            hp = core.RunHparams(lam=jnp.float32(config.ppo.lam), gamma=jnp.float32(1.0),
                                 ngram=jnp.int32(n), variant=jnp.int32(0))
            rollout = jax.jit(functools.partial(core.rollout_phase, static, mods))
            update = jax.jit(functools.partial(core.update_phase, static, mods))
            step = jax.jit(functools.partial(core.ppo_step, static, mods))
            exp, roll_metrics = rollout(state, frozen, ids, mask)
            times[name] = dict(
                rollout=best_time(lambda: rollout(state, frozen, ids, mask), args.repeats),
                update=best_time(lambda: update(state, exp, roll_metrics, hp), args.repeats),
                step=best_time(lambda: step(state, frozen, hp, ids, mask), args.repeats),
                tokens=int(exp.response_mask.sum()) + int(mask.sum()))
        pipe.close()

    print(f"PPO vs MA-PPO (n={config.ppo.ngram}) step, batch {args.batch} prompts, "
          f"backend={jax.default_backend()}, best of {args.repeats}")
    for name, t in times.items():
        print(f"  {name:7s} rollout {t['rollout'] * 1e3:8.1f} ms "
              f"({t['tokens'] / t['rollout']:9.0f} tok/s)   update {t['update'] * 1e3:8.1f} ms "
              f"({t['tokens'] / t['update']:9.0f} tok/s)   whole step {t['step'] * 1e3:8.1f} ms")
    overhead = times["ma_ppo"]["step"] / times["ppo"]["step"] - 1
    print(f"  MA-PPO step overhead vs PPO: {overhead * 100:+.1f}% (target <= 3%)")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
