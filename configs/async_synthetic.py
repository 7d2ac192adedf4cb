"""What staleness costs per step and saves per second, on the synthetic task: token PPO and
MA-PPO (5-grams), each synchronous (k = 0) and with the sampler k = 1, 2, 4 versions ahead
(every long response continuing under newer weights, the behaviour -> proximal weight per
token), and at k = 2 with every response decoded by one version (no partial rollouts), with no
correction, and (MA-PPO) with the weight per macro action. docs/async.md, "The study".

    python experiments/run.py --config=configs/async_synthetic.py --workdir=runs/async_0-3
    python experiments/run.py --config=configs/async_synthetic.py \\
        --config.seeds="(4,5,6,7)" --workdir=runs/async_4-7

Each (arm, variant, seed) is a `stage=ppo` run of its own (`marl_jax/async_study.py`), from the
SFT policy and reward model of configs/synthetic.py (trained once, `config.seed`), evaluated
every 20 of its 120 steps on the 128 held-out prompts. A variant is compared with its arm's
synchronous run, paired per seed.
"""
import ml_collections

from configs import synthetic

TOKEN_CORRECTION = dict(ppo=dict(rollout_correction="token"))


def _variant(k, **rollout):
    return dict(rollout=dict(max_staleness=k, **rollout), **TOKEN_CORRECTION)


def get_config():
    c = synthetic.get_config()
    c.stage = "async_study"
    c.seeds = (0, 1, 2, 3)
    c.ppo.eval_every = 20
    c.checkpoint_every = 20
    r = c.ppo.response_length
    c.async_study = ml_collections.ConfigDict(dict(
        arms=("ppo", "ma_ppo"),
        baseline="k0",
        variants=dict(
            k0={},
            k1=_variant(1),
            k2=_variant(2),
            k4=_variant(4),
            # One version per response: its first chunk is the whole budget (the oldest of the
            # batch's k versions decodes it), none continues under newer weights.
            k2_whole=_variant(2, chunk_tokens=r),
            k2_uncorrected=dict(rollout=dict(max_staleness=2),
                                ppo=dict(rollout_correction="none")),
            k2_macro=dict(rollout=dict(max_staleness=2), ppo=dict(rollout_correction="macro")),
        ),
        # Variants run for some arms only: the macro-level weight needs macro actions.
        only=dict(k2_macro=("ma_ppo",)),
    ))
    return c
