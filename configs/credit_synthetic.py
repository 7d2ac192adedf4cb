"""How right is each advantage on the synthetic task: one token-PPO run (the default
experiment's `ppo` arm, its critic trained as the run trains it) probed at its start, middle
and end (`config.credit`, `marl_jax/credit/`): every estimator's advantages on the
same rollout of 8 held-out prompts x 4 samples, scored against Monte Carlo ground truth from
8 continuations of every state of every response.

    python experiments/run.py --config=configs/credit_synthetic.py --workdir=runs/credit/seed_0
    python experiments/credit_report.py runs/credit/seed_{0,1} runs/credit/seed_{2,3} \
        --page docs/credit.md

`--config.seed` picks the run (its own SFT, reward model and PPO); the probe's prompts are the
task's first held-out prompts, its keys `credit.seed`, the run's seed and the step. Sizes: configs/synthetic.py's,
with PPO evaluated every 20 steps and checkpointed at every probe.
"""
from configs import synthetic


def get_config():
    c = synthetic.get_config()
    c.stage = "all"
    c.seeds = (0,)
    c.ppo.eval_every = 20
    c.credit.update(dict(every=c.ppo.steps // 2, prompts=8, group_size=4, continuations=8))
    # A checkpoint at every probe, all kept: a probe's states can be valued again from the
    # policy and critic it saw (step 0's are the SFT policy and the initial critic).
    c.checkpoint_every = c.credit.every
    c.max_to_keep = 3
    return c
