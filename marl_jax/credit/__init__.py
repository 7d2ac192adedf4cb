"""How right is each advantage (`config.credit`, docs/credit.md): the advantage-quality probe of
a PPO run, its Monte Carlo ground truth, the estimators' scores against it and the recheck of
that truth.

Where it sits in the data flow: the pipeline (`marl_jax/pipeline.py`) hands the PPO loop
(`train.ppo.run_ppo`) the probe (`hook.ppo_probe`), as it hands it the metrics writer. At step 0
and every `credit.every` steps, beside the held-out evaluation, the loop calls the probe with
its state; the probe samples fresh responses to held-out prompts (or plays a multi-turn task's
episodes) with the rollout engine, scores them with the run's own phases and estimators, values
every state by continuations of the policy (the engine's `continue_responses`, and on a
multi-turn task the engine's own turn rules, `rollout.turns.end_turns`), and writes a `credit`
metrics row and `<workdir>/credit/step_<n>.npz`, which experiments/credit_report.py pools into
docs/credit.md and experiments/credit_revalue.py rechecks. The package imports the engine,
`train/` and `eval/`; none of them imports it: the loop knows the probe only as the callback it
is handed.

- `hook.py`: the probe a run is handed (`ppo_probe`).
- `probe.py`: the single-response probe (`CreditProbe`): its draws and the estimators' advantages.
- `turn_probe.py`: the multi-turn probe (`TurnCreditProbe`).
- `truth.py`: Monte Carlo state values and A* of single responses.
- `turn_truth.py`: Monte Carlo state values on multi-turn trajectories.
- `probe_scores.py`: a saved probe's states per level and its scores.
- `estimator_scores.py`: correlations with A*, their bootstrap intervals, paired differences.
- `recheck.py`: the split test of a probe's saved continuation returns against fresh ones.
"""
