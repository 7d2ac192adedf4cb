"""Two successors' boundary rules as arms of the default experiment, against token PPO and
each rule's matched token-PPO control (lam^(1/L), L measured on the arm's first rollouts):
`low_probability` (SAE's low-probability boundaries) and `entropy` (forking tokens), the rules
the default experiment does not already run (its `ma_ppo` is the fixed rule).

    python experiments/run.py --config=configs/credit_arms_synthetic.py --workdir=runs/credit_arms_0-11
    python experiments/run.py --config=configs/credit_arms_synthetic.py --workdir=runs/credit_arms_12-23 \
        --config.seeds='(12,13,14,15,16,17,18,19,20,21,22,23)'

They were chosen when an earlier advantage-quality probe ranked `low_probability` first; its
probes shared their random numbers across seeds, and the regenerated probe (independent draws,
a paired test between rules, docs/credit.md) finds no rule whose advantages are closer to the
truth than every other's on both seed sets. The arms are a study of these two rules, not of
the best-valued ones.
Sizes and every other setting: configs/synthetic.py's.
"""
from configs import synthetic


def get_config():
    c = synthetic.get_config()
    c.experiment.arms = ("ppo", "low_probability", "entropy")
    c.experiment.add_controls = True
    return c
