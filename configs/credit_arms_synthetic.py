"""The boundary rules whose advantages are closest to the ground truth on the synthetic task
(docs/credit.md) as arms of the default experiment, against token PPO and each rule's matched
token-PPO control (lam^(1/L), L measured on the arm's first rollouts).

    python experiments/run.py --config=configs/credit_arms_synthetic.py --workdir=runs/credit_arms_0-11
    python experiments/run.py --config=configs/credit_arms_synthetic.py --workdir=runs/credit_arms_12-23 \
        --config.seeds='(12,13,14,15,16,17,18,19,20,21,22,23)'

`low_probability` (SAE's rule) gave MA-PPO's macro GAE the highest token-level correlation with
A* on both seed sets of the probe; the second place was not distinguishable between the rules
(fixed 5-grams on one set, `entropy` on the other), and `entropy` (forking tokens) is the other
successor's rule the default experiment does not already run (its `ma_ppo` is the fixed rule).
Sizes and every other setting: configs/synthetic.py's.
"""
from configs import synthetic


def get_config():
    c = synthetic.get_config()
    c.experiment.arms = ("ppo", "low_probability", "entropy")
    c.experiment.add_controls = True
    return c
