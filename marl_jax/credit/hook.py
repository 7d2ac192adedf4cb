"""The advantage-quality probe a PPO run is handed (`config.credit`): the pipeline gives
`train.ppo.run_ppo` what `ppo_probe` returns, as it gives it the metrics writer."""
from __future__ import annotations

from marl_jax.credit.probe import CreditProbe
from marl_jax.credit.turn_probe import TurnCreditProbe


def ppo_probe(config, task, workdir: str):
    """None where `credit.every` is 0, else `make(static, models) -> probe` for `run_ppo`:
    `TurnCreditProbe` where the task plays an environment, else `CreditProbe`; a probe answers
    `due(step) -> bool` and `probe(state, frozen, hparams, step) -> a credit metrics row` (its
    inputs saved under `<workdir>/credit/`)."""
    if config.get("credit") is None or not config.credit.every:
        return None
    probe = TurnCreditProbe if task.turn_callback is not None else CreditProbe
    return lambda static, models: probe(config, task, static, models, workdir)
