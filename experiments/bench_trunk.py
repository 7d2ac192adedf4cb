"""A PPO step's phases with and without the shared frozen trunk, side by side.

`python experiments/bench.py trunk [--config configs/real_text_smollm2.py] [--batch 8]
[--repeats 8]`

With `num_layers_unfrozen` = n the actor, reference, critic and reward model share their
embeddings and first L - n layers (`ppo.with_shared_trunk`); the step then runs those layers
once for the scoring pass and once for the update instead of once per model and pass. Times
sampling, scoring and the update separately on the config's model with its real weights (the
reward model and critic take the policy's backbone, as when they start from the SFT policy):
after a compiling call of each, the two programs of a phase are timed in `--repeats` pairs,
called alternately (`bench_timing.paired_times`), and each phase's shared / whole is the
median of the paired ratios with its 95% distribution-free interval (at least 6 pairs).
"""
import functools
import sys
import tempfile

import jax
import jax.numpy as jnp

import numpy as np

from bench_timing import load_config, median_ratio, paired_times, ratio_line, step_timing_args



def main(argv):
    args = step_timing_args(argv, prog="bench.py trunk", doc=__doc__, config="real_text_smollm2.py",
                            batch=8, repeats=8)

    from marl_jax import models
    from marl_jax.pipeline import Pipeline
    from marl_jax.train import ppo as ppo_lib
    from marl_jax.train import phases, ppo_core as core, ppo_types

    config = load_config(args.config)
    config.ppo.batch_size = args.batch
    if config.ppo.num_layers_unfrozen < 0:
        raise SystemExit(f"{args.config}: ppo.num_layers_unfrozen = -1 trains every layer; "
                         "nothing is shared")
    with tempfile.TemporaryDirectory() as workdir:
        pipe = Pipeline(config, workdir)
        policy_params = pipe.initial_params()
        fresh = models.init_params(pipe.reward_model, jax.random.key(1))
        rm_params = dict(fresh, backbone=policy_params["backbone"])
        ids = jnp.asarray(pipe.task.rl["ids"][:args.batch])
        mask = jnp.asarray(pipe.task.rl["mask"][:args.batch])
        frozen = ppo_types.Frozen(policy_params, rm_params, jnp.float32(0), jnp.float32(1))
        mods = ppo_lib.make_models(config, pipe.policy, pipe.critic, pipe.reward_model)
        critic_params = ppo_lib.initial_critic_params(
            config, pipe.critic, policy_params, rm_params, jax.random.key(2),
            {"mean": 0.0, "std": 1.0})
        hp = ppo_lib.hparams_from_config(config.ppo)
        whole = ppo_lib.static_from_config(config, pipe.task.tokenizer)
        shared = ppo_lib.with_shared_trunk(whole, pipe.policy.config.num_layers, policy_params,
                                           rm_params, [critic_params])
        layers = pipe.policy.config.num_layers
        calls = {}
        for name, static in (("whole", whole), ("shared", shared)):
            state = ppo_lib.initial_state(config, mods, policy_params, critic_params, seed=0)
            generate = jax.jit(functools.partial(core.generate_phase, static, mods))
            score = jax.jit(functools.partial(phases.score.score, static, mods))
            update = jax.jit(functools.partial(core.update_phase, static, mods))
            sample = generate(state, ids, mask)
            scored = functools.partial(score, state, frozen, ids, mask, sample.tokens,
                                       sample.mask.astype(jnp.int32), None, None,
                                       sample.logprobs, sample.entropy)
            exp, roll_metrics = scored()
            calls[name] = dict(generate=functools.partial(generate, state, ids, mask),
                               score=scored,
                               update=functools.partial(update, state, exp, roll_metrics, hp))
        times = {"whole": {}, "shared": {}}
        for phase in ("generate", "score", "update"):
            times["shared"][phase], times["whole"][phase] = paired_times(
                calls["shared"][phase], calls["whole"][phase], args.repeats)
        pipe.close()

    print(f"PPO step phases, {layers} layers, {shared.shared_trunk_layers} shared "
          f"(num_layers_unfrozen={config.ppo.num_layers_unfrozen}), batch {args.batch}, "
          f"response {config.ppo.response_length} tokens, prompt {ids.shape[1]}, "
          f"backend={jax.default_backend()}, {args.repeats} pairs of calls, alternated; "
          "median times")
    for name, t in times.items():
        med = {k: float(np.median(v)) for k, v in t.items()}
        print(f"  {name:6s} generate {med['generate']:6.2f} s   score {med['score']:6.2f} s   "
              f"update {med['update']:6.2f} s   sum {sum(med.values()):6.2f} s")
    for phase in ("score", "update"):
        print("  " + ratio_line(median_ratio(times["shared"][phase], times["whole"][phase]),
                                f"shared / whole {phase}"))
    total = {name: sum(t.values()) for name, t in times.items()}  # per pair: the three phases
    print("  " + ratio_line(median_ratio(total["shared"], total["whole"]), "shared / whole sum"))

if __name__ == "__main__":
    main(sys.argv[1:])
