"""The paper's ablations on the synthetic task, each arm beside its matched token-PPO control,
in the default experiment's report format.

    python experiments/run.py --config=configs/synthetic_sweep.py

Arms (MA-PPO with fixed 5-gram macros, `equal` weighting and `weighted` rewards unless the arm
says otherwise; `ppo` is the token-level baseline every comparison refers to), and for every
macro arm its control `<arm>_ctrl` (token PPO with lam^(1/L) and, for `weighted` rewards,
kl_coef / L; L = n for fixed n-grams, measured on the arm's own first rollout otherwise):
- n in {3, 5, 10, infinity} (n = 1 is `ppo`);
- termination: fixed (n5), randomized n-grams, perplexity-based;
- value weighting: equal, unit, position, first; reward aggregation: weighted, sum;
- lam = 1 for PPO and for MA-PPO;
- the critic axis: every other arm's critic starts from the reward model (rescaled to normalised
  scores); `ppo_cold_critic` and `ma_ppo_cold_critic` start it from scratch;
and the whole set at a short (2 items, ~25 tokens) and a long (8 items, ~96 tokens) horizon, each
horizon with its own SFT policy and reward model, in `<workdir>/horizon_<items>/`.
"""
from configs import synthetic


def get_config():
    c = synthetic.get_config()
    c.experiment.arms = (
        "ppo", "n3", "n5", "n10", "n_inf",
        "randomized", "perplexity",
        "equal", "unit", "position", "first",
        "agg_weighted", "agg_sum",
        "ppo_lam1", "ma_ppo_lam1",
        "ppo_cold_critic", "ma_ppo_cold_critic",
    )
    c.experiment.add_controls = True
    c.experiment.horizons = (2, 8)
    return c
