"""How right is each advantage on the multi-turn task (configs/multiturn_synthetic.py: the
calculator environment, its word tokenizer and its reward, no reward model): one token-PPO run
(the study's `ppo` arm, its critic trained as the run trains it) probed at its start, middle and
end (`config.credit`, `marl_jax/credit/`): every estimator's advantages on the same
rollout of 8 held-out problems x 4 trajectories, scored against Monte Carlo ground truth from 8
continuations (played in the environment) of every state of every trajectory.

    python experiments/run.py --config=configs/credit_multiturn.py \
        --workdir=runs/credit_multiturn/seed_0
    python experiments/credit_report.py runs/credit_multiturn/seed_{0,1} \
        runs/credit_multiturn/seed_{2,3} --page docs/credit.md --marker credit-multiturn \
        --results docs/credit_multiturn_results.json --plot docs/credit_multiturn.png

The rules cut within turns (`fixed` 5-grams, `low_probability`, `entropy`), and `turn` makes
each assistant turn one macro. `--config.seed` picks the run (its own SFT and PPO); the probe's
prompts are the task's first held-out problems. Sizes: configs/multiturn_synthetic.py's, with
PPO evaluated and checkpointed at every probe. One run: 5 to 6.5 minutes on a 2-core CPU.
"""
from configs import multiturn_synthetic


def get_config():
    c = multiturn_synthetic.get_config()
    c.stage = "all"
    c.seeds = (0,)
    c.ppo.eval_every = c.ppo.steps // 2
    c.credit.update({"every": c.ppo.steps // 2, "prompts": 8, "group_size": 4,
                     "continuations": 8, "rules": ("fixed", "low_probability", "entropy", "turn"),
                     "weightings": ("equal", "first")})
    # A checkpoint at every probe, all kept: a probe's states can be valued again from the
    # policy and critic it saw (step 0's are the SFT policy and the initial critic).
    c.checkpoint_every = c.credit.every
    c.max_to_keep = 3
    return c
