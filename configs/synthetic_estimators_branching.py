"""Where Monte Carlo values are worth their samples: every macro start vs a few states, at a
matched sampling budget (configs/synthetic_estimators.py found 2 continuations at 3 branch
points too noisy to beat PPO).

    python experiments/run.py --config=configs/synthetic_estimators_branching.py

Arms, each ~14-18 responses' worth of generated tokens a step (responses are ~55 tokens, so a
5-gram response has ~11 macro starts, and a continuation from the start of macro j samples the
~(11 - j) / 11 of the response after it):
  ppo                  GAE with a critic, 16 prompts x 1 sample
  macro_mc_n5_all      a value at every 5-gram start (~11 states), 1 continuation each,
                       2 prompts: 2 x (1 + 6) = 14
  macro_mc_n1          the same number of states (11, at random tokens) and continuations:
                       token-level Monte Carlo at the macro arm's cost, 14
  macro_mc_n5          3 macro starts, 4 continuations each (less noisy values at fewer
                       states), 2 prompts: 2 x (1 + 4 x 2) = 18
"""
import ml_collections

from configs import synthetic_estimators


def get_config():
    c = synthetic_estimators.get_config()
    c.experiment.arms = ("ppo", "macro_mc_n5_all", "macro_mc_n1", "macro_mc_n5")
    # The report pairs the macro arm with the token-level arm of the same cost.
    c.experiment.controls = ml_collections.ConfigDict(dict(macro_mc_n5_all="macro_mc_n1"))
    c.ppo.arm_overrides = ml_collections.ConfigDict(dict(
        macro_mc_n5_all=dict(batch_size=2, mc_rollouts=1),
        macro_mc_n1=dict(batch_size=2, mc_rollouts=1, mc_branch_points=11),
        macro_mc_n5=dict(batch_size=2, mc_rollouts=4, mc_branch_points=3),
    ))
    return c
