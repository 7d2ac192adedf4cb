"""The policy objectives against their matched controls, on the default experiment's task, models
and reward model (configs/synthetic.py):

    python experiments/run.py --config=configs/synthetic_objectives.py

Arms, each against its control (the same advantages, the objective alone changed):
  ma_ppo_smdp_macro_product    the semi-MDP MA-PPO (5-gram macros) with one ratio per macro
                               action, the product of its tokens' ratios, clipped once (the
                               MA-RLHF paper's objective)     vs ma_ppo_smdp (token ratios, the
                               official code's)
  ma_ppo_smdp_macro_geometric  the same with the geometric mean of its tokens' ratios
                                                              vs ma_ppo_smdp
  ppo_sequence_geometric       token PPO with one length-normalised ratio per response and
                               GSPO's clip ranges 3e-4 / 4e-4 (GSPO's ratio on GAE advantages)
                                                              vs ppo
  dapo                         DAPO as published (`estimators.ESTIMATORS["dapo"]`): GRPO's
                               advantages, clip 0.2 / 0.28, token mean, dynamic sampling over 3x
                               the prompts, soft overlong punishment over the last 14 of 72
                               tokens up to 1, no KL term      vs grpo (4 prompts x 4 samples)
  ppo                          the baseline every arm is also compared with.

Size and why: 4 minibatches of 4 rows per step (GSPO's 4 minibatches per rollout batch) for
every arm, so the policy moves between a rollout and its later updates and the ratios and their
clipping act (with one update per rollout every ratio is 1 and the objectives differ only in how
their gradients are weighted). 100 steps, 12 seeds a set, evaluated every 10 steps on 128
held-out prompts; the other settings are the default experiment's. A run of 12 seeds takes
about 20 minutes on a 2-core CPU (seeds 0-11: 1195 s; the arms run as 6 vmapped programs, one
per static objective, DAPO's sampling 3 x the prompts).
Replicate on disjoint seeds with `--config.seeds='(100,101,...,111)'`; the documentation states
a difference only when its interval excludes 0 on both sets (experiments/objectives_results.py).
"""
import ml_collections

from configs import synthetic


def get_config():
    c = synthetic.get_config()
    c.experiment.arms = ("ppo", "ppo_sequence_geometric", "ma_ppo_smdp",
                         "ma_ppo_smdp_macro_product", "ma_ppo_smdp_macro_geometric", "grpo",
                         "dapo")
    c.experiment.add_controls = False
    c.experiment.controls = ml_collections.ConfigDict(dict(
        ppo_sequence_geometric="ppo",
        ma_ppo_smdp_macro_product="ma_ppo_smdp",
        ma_ppo_smdp_macro_geometric="ma_ppo_smdp",
        dapo="grpo",
    ))
    c.seeds = tuple(range(12))
    c.ppo.steps = 100
    c.ppo.eval_every = 10
    c.ppo.num_minibatches = 4
    c.ppo.arm_overrides = ml_collections.ConfigDict(dict(
        grpo=dict(group_size=4),
        dapo=dict(group_size=4),
    ))
    return c
