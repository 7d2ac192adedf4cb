"""MA-PPO vs PPO step time at identical shapes, and tokens/s of each phase.

`python experiments/bench.py step [--batch 16] [--repeats 200] [--config configs/synthetic.py]`

Both arms start from the same parameters and the same key, so their rollouts are identical
token for token; they differ only in termination + macro GAE (MA-PPO: fixed 5-grams, `equal`
weighting, `weighted` rewards; PPO: n = 1). The paper claims macro actions add no compute; the
target is at most 3% overhead on a whole step.

Each phase (rollout, update, whole step) of the two arms is timed in `--repeats` pairs, the
arms called alternately (`bench_timing.paired_times`); the result is the median of the paired
ratios MA-PPO / PPO with its 95% distribution-free interval, and whether that interval lies
within 3%, above it, or is too wide to tell.
"""
import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from bench_timing import load_config, median_ratio, paired_times, ratio_line, step_timing_args

CLAIM = 0.03  # "an MA-PPO step within 3% of a PPO step"


def main(argv):
    args = step_timing_args(argv, prog="bench.py step", doc=__doc__, config="synthetic.py",
                            batch=16, repeats=200)

    from marl_jax.pipeline import Pipeline
    from marl_jax.train import ppo as ppo_lib
    from marl_jax.train import ppo_core as core, ppo_types
    from marl_jax import models

    config = load_config(args.config)
    config.ppo.batch_size = args.batch
    with tempfile.TemporaryDirectory() as workdir:
        pipe = Pipeline(config, workdir)
        policy_params = models.init_params(pipe.policy, jax.random.key(0))
        rm_params = models.init_params(pipe.reward_model, jax.random.key(1))
        ids = jnp.asarray(pipe.task.rl["ids"][:args.batch])
        mask = jnp.asarray(pipe.task.rl["mask"][:args.batch])
        frozen = ppo_types.Frozen(policy_params, rm_params, jnp.float32(0), jnp.float32(1))
        arms = {"ppo": (1, ("fixed", "equal", "weighted")),
                "ma_ppo": (config.ppo.ngram, ("fixed", "equal", "weighted"))}
        calls = {}
        for name, (n, variant) in arms.items():
            static = ppo_lib.static_from_config(config, pipe.task.tokenizer, variants=(variant,))
            mods = ppo_lib.make_models(config, pipe.policy, pipe.critic, pipe.reward_model)
            critic_params = ppo_lib.initial_critic_params(
                config, pipe.critic, policy_params, rm_params, jax.random.key(2),
                {"mean": 0.0, "std": 1.0})
            state = ppo_lib.initial_state(config, mods, policy_params, critic_params, seed=0)
            hp = ppo_types.RunHparams(lam=jnp.float32(config.ppo.lam), gamma=jnp.float32(1.0),
                                 ngram=jnp.int32(n), variant=jnp.int32(0))
            rollout = jax.jit(functools.partial(core.rollout_phase, static, mods))
            update = jax.jit(functools.partial(core.update_phase, static, mods))
            step = jax.jit(functools.partial(core.ppo_step, static, mods))
            exp, roll_metrics = rollout(state, frozen, ids, mask)
            calls[name] = dict(
                rollout=functools.partial(rollout, state, frozen, ids, mask),
                update=functools.partial(update, state, exp, roll_metrics, hp),
                step=functools.partial(step, state, frozen, hp, ids, mask))
            tokens = int(exp.response_mask.sum()) + int(mask.sum())
        times = {"ppo": {}, "ma_ppo": {}}
        for phase in ("rollout", "update", "step"):
            times["ma_ppo"][phase], times["ppo"][phase] = paired_times(
                calls["ma_ppo"][phase], calls["ppo"][phase], args.repeats)
        pipe.close()

    print(f"PPO vs MA-PPO (n={config.ppo.ngram}) step, batch {args.batch} prompts, "
          f"backend={jax.default_backend()}, {args.repeats} pairs of calls, alternated; "
          "median times")
    for name, t in times.items():
        rollout, update, step = (float(np.median(t[k])) for k in ("rollout", "update", "step"))
        print(f"  {name:7s} rollout {rollout * 1e3:8.1f} ms ({tokens / rollout:9.0f} tok/s)   "
              f"update {update * 1e3:8.1f} ms ({tokens / update:9.0f} tok/s)   "
              f"whole step {step * 1e3:8.1f} ms")
    for phase in ("rollout", "update"):
        print("  " + ratio_line(median_ratio(times["ma_ppo"][phase], times["ppo"][phase]),
                                f"MA-PPO / PPO {phase}"))
    print("  " + ratio_line(median_ratio(times["ma_ppo"]["step"], times["ppo"]["step"]),
                            "MA-PPO / PPO whole step", claim=CLAIM))

if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
