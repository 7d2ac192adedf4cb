"""Critic-free estimators against PPO and MA-PPO at a matched sampling budget, on the default
experiment's task, model, reward model and seeds (configs/synthetic.py).

    python experiments/run.py --config=configs/synthetic_estimators.py

Arms (each run counts every token it samples, `generated_tokens` in the evaluation rows):
  ppo, ma_ppo_smdp   GAE with a critic (token level / 5-gram macros, the semi-MDP choices);
                     16 prompts x 1 sample per step
  grpo, dr_grpo, rloo
                     group baselines, no critic: 4 prompts x 4 samples
  reinforce_pp       REINFORCE++ (batch-normalised returns, per-token KL), no critic:
                     16 prompts x 1 sample
  macro_mc_n1        Monte Carlo values, no critic (VinePPO-like): 4 prompts x 1 sample, and
                     at 3 branch points per response (the start and 2 random tokens) 2
                     continuations each
  macro_mc_n5        the same with the branch points at 5-gram macro starts
A step of every arm samples about the same number of tokens: 16 responses for the first six;
4 responses plus 4 x (1 full + 2 partial) x 2 continuations (about 4 x 4 response lengths)
for the Monte Carlo arms. The report plots gold against generated tokens and training time and
says which estimator reaches PPO's final gold with the fewest generated tokens, with intervals.
"""
import ml_collections

from configs import synthetic


def get_config():
    c = synthetic.get_config()
    c.experiment.arms = ("ppo", "ma_ppo_smdp", "grpo", "dr_grpo", "rloo", "reinforce_pp",
                         "macro_mc_n1", "macro_mc_n5")
    c.experiment.add_controls = False
    c.seeds = tuple(range(8))  # the first 8 of the study's seeds: 8 arms in 6 compiled groups
    c.ppo.steps = 100
    c.ppo.mc_rollouts = 2
    c.ppo.mc_branch_points = 3
    # Per-arm sizes (the static fields of experiment.STATIC_FIELDS) at a matched budget.
    c.ppo.arm_overrides = ml_collections.ConfigDict(dict(
        grpo=dict(group_size=4),
        dr_grpo=dict(group_size=4),
        rloo=dict(group_size=4),
        macro_mc_n1=dict(batch_size=4),
        macro_mc_n5=dict(batch_size=4),
    ))
    return c
