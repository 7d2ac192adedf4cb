"""Values a credit probe's states again from fresh continuations of the policy the probe saw, and
says whether the probe's saved ground truth agrees with them.

    python experiments/credit_revalue.py runs/credit/seed_0 --config=configs/credit_synthetic.py \
        --config.seed=0 --step 60 --states 16 --continuations 32 --seed 7 [--json out.json]

The config is the run's (its file and the same `--config.<field>=<value>` overrides as
experiments/run.py takes). The policy and critic of probe step N are restored from the run's
workdir: the PPO checkpoint of step N, or at step 0 the run's SFT policy and initial critic
(rebuilt from its finished SFT and reward-model stages). `--states` response tokens t of row b
of `<workdir>/credit/step_<N>.npz` are drawn at random (seed `--seed`); the states (b, t) and
(b, t + 1) of each are valued again from `--continuations` continuations drawn with keys from
`--seed` (never the probe's), rewarded by the run's own per-token reward, and each token's
A*_t = r_t + gamma V(s_{t+1}) - V(s_t) recomputed. The states' saved continuation returns
(`state_returns`) and the fresh ones are compared by the split test of
marl_jax/credit/recheck.py (every state's z under the variance of its pooled returns, and
the p-value of their sum of squares over random splits of the pooled returns: valid at any
number of continuations and any return distribution); every token's A* gets its z too.

Exit status 0: consistent (p >= 0.001, and the restored policy gives the probe's own rewards and
critic values); 1: not, said in one line; 2: an input error (no probe or no policy at step N:
the steps that have both are listed), one line `error: <message>`.
"""
import json
import os
import pathlib
import re
import sys
import time
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
if __name__ == "__main__":
    from marl_jax import dependencies

    if dependencies.check():
        sys.exit(2)

import numpy as np
from absl import app, flags, logging

# Folded into the key of `--seed`: a key stream the probe never draws from.
KEY_STREAM = 1 << 20
# The restored policy must give the probe's own rewards and critic values within this.
RTOL, ATOL = 1e-3, 1e-4


def probe_steps(workdir) -> list[int]:
    """Steps of the probes saved in `<workdir>/credit/`."""
    directory = os.path.join(workdir, "credit")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(m.group(1)) for m in map(re.compile(r"step_(\d+)\.npz$").match, names) if m)


def checkpoint_steps(workdir) -> list[int]:
    """Steps of the PPO checkpoints in `<workdir>/checkpoints/ppo`."""
    from marl_jax.train import checkpoint

    return checkpoint.all_steps(checkpoint.checkpoint_dir(workdir, "ppo"))


def check_step(workdir, step: int) -> None:
    """One-line ValueError unless `step` has a saved probe and a policy to restore (step 0's
    is the SFT policy, any other a PPO checkpoint)."""
    probes, saved = probe_steps(workdir), checkpoint_steps(workdir)
    usable = [s for s in probes if s == 0 or s in saved]
    if step not in probes:
        why = f"no probe was saved at step {step} (credit/step_{step}.npz; probes at {probes})"
    elif step not in usable:
        why = f"no PPO checkpoint at step {step} (checkpoints/ppo has steps {saved})"
    else:
        return
    raise ValueError(f"{workdir}: {why}; steps with a probe and its policy: {usable}")


class ProbePolicy(NamedTuple):
    """What a probe scored with: the PPO statics, models, state and frozen roles of its step,
    the mesh and logical rules its programs run under, and the run's per-token reward
    `(prompt_ids, prompt_mask, response_ids, response_mask, *, rows) -> [N, R]` (rows: the
    probe's response rows scored or continued) and scoring of the probe's responses
    `(prompt_ids, prompt_mask, response_ids, response_mask) -> (rewards, values) [N, R]` under
    that state."""

    static: object
    models: object
    state: object
    frozen: object
    mesh: object
    rules: object
    reward_fn: object
    score_fn: object


def restore_policy(config, workdir, step: int) -> ProbePolicy:
    """The policy, critic and reward of probe `step` of the run in `workdir`, built as
    `ppo.run_ppo` builds its start and restored from the PPO checkpoint of `step` (step 0:
    that start)."""
    import functools

    import jax

    from marl_jax import pipeline as pipeline_lib
    from marl_jax.credit import probe as credit
    from marl_jax.train import build, checkpoint, programs, sharding
    from marl_jax.train import ppo as ppo_lib
    from marl_jax.train.phases import score

    pipe = pipeline_lib.Pipeline(config, workdir, run_earlier_stages=False)
    try:
        if pipe.task.turn_callback is not None:
            raise ValueError("credit_revalue values single-turn probes; this task is multi-turn")
        rm_params, stats = pipe.rm(needed_by="ppo")
        sft_params = pipe.sft(needed_by="ppo")
    finally:
        pipe.close()
    policy, critic, mesh = pipe.policy, pipe.critic, pipe.mesh
    static = ppo_lib.static_from_config(config, pipe.task.tokenizer)
    models = ppo_lib.make_models(config, policy, critic, pipe.reward_model, pipe.task.gold_fn)
    key = jax.random.key(config.seed)
    critic_params = ppo_lib.initial_critic_params(config, critic, sft_params, rm_params,
                                                  jax.random.fold_in(key, 1), stats)
    static = ppo_lib.with_shared_trunk(static, policy.config.num_layers, sft_params, rm_params,
                                       [critic_params])
    ref_params, ref_adapters = sft_params, None
    if static.lora:
        ref_params, ref_adapters, sft_params, rm_params, critic_params = ppo_lib.lora_roles(
            policy, critic, sft_params, rm_params, critic_params, key)
    state_sh = ppo_lib.state_shardings(models, mesh, sft_params, critic_params)
    frozen_sh = programs.frozen_shardings(models, mesh, state_sh, rm_params,
                                          ref_params if static.lora else None, ref_adapters)
    frozen = jax.device_put(ppo_lib.frozen_models(models, ref_params, rm_params, stats,
                                                  ref_adapters, static.lora), frozen_sh)
    state = jax.device_put(ppo_lib.initial_state(config, models, sft_params, critic_params,
                                                 config.seed), state_sh, may_alias=False)
    if step:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        with checkpoint.Checkpointer(checkpoint.checkpoint_dir(workdir, "ppo"), max_to_keep=None,
                                     async_save=False, read_only=True) as saved:
            state, _ = saved.restore(step, abstract, state_sh)
    reward = jax.jit(functools.partial(credit.run_token_rewards, static, models))
    group_size = int(config.credit.group_size)
    documents = credit.probe_documents(pipe.task, static, int(config.credit.prompts))
    row_documents = None if documents is None else jax.numpy.repeat(documents, group_size, 0)

    def scored(state, frozen, *batch):
        exp, _ = score.score(static, models, state, frozen, *batch)
        return exp.rewards, exp.values

    scored = jax.jit(scored)
    return ProbePolicy(
        static=static, models=models, state=state, frozen=frozen, mesh=mesh,
        rules=sharding.logical_rules(mesh, build.model_dims(policy.config)),
        reward_fn=credit.run_reward_fn(reward, state, frozen, documents, group_size),
        score_fn=lambda *batch: scored(state, frozen, *batch, row_documents))


def revalue(policy: ProbePolicy, inputs: dict, *, states: int, continuations: int,
            seed: int) -> dict:
    """The comparison of a probe's saved states and token A* (`inputs`: its npz's arrays) with
    the same values from `continuations` fresh continuations of `states` drawn tokens' states
    (see the module): {"tokens": ..., "states": ..., "reproduced": ..., "consistent"}."""
    import jax
    import jax.numpy as jnp

    from marl_jax.credit import recheck as credit_recheck
    from marl_jax.credit import truth as credit_truth
    from marl_jax.train import sharding
    from marl_jax.train.ppo_types import role_params

    truth = str(inputs.get("truth", "reward"))
    if truth != "reward":
        raise ValueError(f"the probe's truth is {truth!r}: only probes valued by the run's own "
                         "reward (credit.truth='reward') are valued again")
    if "state_returns" not in inputs:
        raise ValueError("the probe saved no continuation returns (state_returns), which the "
                         "split test compares with fresh ones: probe the run again")
    mask = inputs["response_mask"]
    rows, positions = credit_recheck.pick_tokens(mask, states, seed)
    if rows.size == 0:
        raise ValueError("the probe's responses have no tokens to value")
    pairs = sorted({(int(b), int(t)) for b, t in zip(rows, positions)}
                   | {(int(b), int(t) + 1) for b, t in zip(rows, positions)})
    state_rows, state_positions = (np.array(x, np.int64) for x in zip(*pairs))
    at = {pair: i for i, pair in enumerate(pairs)}
    saved_at = {(int(b), int(t)): i for i, (b, t) in enumerate(zip(inputs["state_rows"],
                                                                 inputs["state_positions"]))}
    saved_index = np.array([saved_at[pair] for pair in pairs], np.int64)
    gamma = float(inputs["gamma"])
    static, frozen = policy.static, policy.frozen
    batch = tuple(jnp.asarray(inputs[k]) for k in ("prompt_ids", "prompt_mask", "response_ids"))
    with sharding.mesh_context(policy.mesh, policy.rules):
        rewards, values = (np.asarray(x, np.float64) for x in policy.score_fn(
            *batch, jnp.asarray(mask, jnp.int32)))
        new = credit_truth.state_values(
            policy.models.policy, role_params(static, "actor", frozen, policy.state.actor_params),
            *batch, mask, state_rows, state_positions, reward_fn=policy.reward_fn,
            key=jax.random.fold_in(jax.random.key(seed), KEY_STREAM),
            num_continuations=continuations, temperature=static.temperature, top_k=static.top_k,
            top_p=static.top_p, eos_id=static.eos_id, pad_id=static.pad_id, gamma=gamma,
            reward_rows=True)
    saved = credit_truth.StateValues(
        rows=state_rows, positions=state_positions, mean=inputs["state_mean"][saved_index],
        se=inputs["state_se"][saved_index], halves=inputs["state_halves"][saved_index],
        returns=None)
    start = np.array([at[(b, t)] for b, t in zip(rows, positions)], np.int64)
    end = np.array([at[(b, t + 1)] for b, t in zip(rows, positions)], np.int64)
    ones = np.ones(rows.size)
    saved_rewards = np.asarray(inputs["rewards"], np.float64)
    saved_a, saved_a_se, _ = credit_truth.span_advantages(saved, start, end,
                                                          saved_rewards[rows, positions], ones,
                                                          gamma)
    new_a, new_a_se, _ = credit_truth.span_advantages(new, start, end, rewards[rows, positions],
                                                      ones, gamma)
    valid = np.asarray(mask) != 0
    reward_diff = float(np.max(np.abs(rewards - saved_rewards)[valid]))
    value_diff = float(np.max(np.abs(values - np.asarray(inputs["values"]))[valid]))
    reproduced = bool(np.allclose(rewards[valid], saved_rewards[valid], rtol=RTOL, atol=ATOL)
                      and np.allclose(values[valid], np.asarray(inputs["values"])[valid],
                                      rtol=RTOL, atol=ATOL))
    saved_returns = np.asarray(inputs["state_returns"], np.float64)[saved_index]
    state_cmp = credit_recheck.split_test(saved_returns, new.returns, seed=seed)
    # A token's A* differs by its two states' differences: its z under the states' null
    # variances (shown beside the states; the verdict is the states' split test).
    k_saved = saved_returns.shape[1]
    variance = np.asarray(state_cmp["variance"])
    token_cmp = credit_recheck.z_summary(credit_recheck.null_z(
        saved_a - new_a, variance[start] + gamma ** 2 * variance[end], k_saved, continuations))
    consistent = state_cmp["p_value"] >= credit_recheck.MIN_P_VALUE
    return {
        "gamma": gamma, "continuations": int(continuations), "saved_continuations": k_saved,
        "seed": int(seed), "min_p_value": credit_recheck.MIN_P_VALUE,
        "states": dict(rows=state_rows.tolist(), positions=state_positions.tolist(),
                       saved_mean=saved.mean.tolist(), saved_se=saved.se.tolist(),
                       new_mean=new.mean.tolist(), new_se=new.se.tolist(), **state_cmp),
        "tokens": dict(rows=rows.tolist(), positions=positions.tolist(),
                       saved_reward=saved_rewards[rows, positions].tolist(),
                       new_reward=rewards[rows, positions].tolist(),
                       saved_advantage=saved_a.tolist(), saved_se=saved_a_se.tolist(),
                       new_advantage=new_a.tolist(), new_se=new_a_se.tolist(), **token_cmp),
        "reproduced": {"ok": reproduced, "max_reward_diff": reward_diff,
                           "max_value_diff": value_diff},
        "consistent": bool(consistent and reproduced),
    }


def _z(x) -> str:
    return "     -" if x is None else f"{x:6.2f}"


def table(report: dict) -> str:
    """The report's states, tokens and verdict as text."""
    s, k = report["states"], report["tokens"]
    lines = ["state (row, t)    saved V +- se        new V +- se          z"]
    for i, (b, t) in enumerate(zip(s["rows"], s["positions"])):
        lines.append(f"  {b:4d} {t:4d}   {s['saved_mean'][i]:8.4f} +- {s['saved_se'][i]:6.4f}  "
                     f"{s['new_mean'][i]:8.4f} +- {s['new_se'][i]:6.4f}  {_z(s['z'][i])}")
    lines.append("token (row, t)    r_t       saved A* +- se       new A* +- se         z")
    for i, (b, t) in enumerate(zip(k["rows"], k["positions"])):
        lines.append(f"  {b:4d} {t:4d}   {k['new_reward'][i]:8.4f}  "
                     f"{k['saved_advantage'][i]:8.4f} +- {k['saved_se'][i]:6.4f}  "
                     f"{k['new_advantage'][i]:8.4f} +- {k['new_se'][i]:6.4f}  {_z(k['z'][i])}")
    lines.append(summary(report))
    return "\n".join(lines)


def summary(report: dict) -> str:
    """One line: the states' and tokens' agreement and the verdict."""
    s, k, r = report["states"], report["tokens"], report["reproduced"]
    line = (f"states: {s['tested']} tested, mean z^2 {s['mean_z2']:.2f}, |z| < 2 for "
            f"{s['frac_within_2']:.0%}, split test T = {s['statistic']:.1f}, p = "
            f"{s['p_value']:.3g} ({s['permutations']} random splits); tokens' A*: mean z^2 "
            f"{k['mean_z2']:.2f}, |z| < 2 for "
            f"{k['frac_within_2']:.0%}; own rewards and values reproduced to "
            f"{max(r['max_reward_diff'], r['max_value_diff']):.1e}")
    if report["consistent"]:
        return line + ": consistent"
    if not r["ok"]:
        return line + (": inconsistent: the restored policy does not give the probe's own "
                       "rewards and critic values (another config or workdir?)")
    return line + (f": inconsistent: the saved values disagree with fresh ones "
                   f"(p < {report['min_p_value']:g})")


def exit_status(report: dict) -> int:
    """The command's exit status for a comparison: 0 when consistent, 1 when not."""
    return 0 if report["consistent"] else 1


def define_flags() -> None:
    """The command's flags beside run.py's (`--config` and its overrides, `--workdir`, which
    may stand for WORKDIR, and `--traceback`), defined when it runs as a script only: a module
    that imports this one gets no flags."""
    import run  # noqa: F401  (defines run.py's flags)

    flags.DEFINE_integer("step", None, "The probe step whose states are valued again.")
    flags.DEFINE_integer("states", 16, "Response tokens drawn; each values two states.")
    flags.DEFINE_integer("continuations", 32, "Fresh continuations per state.")
    flags.DEFINE_integer("seed", 7, "Seed of the drawn tokens and of the continuations' keys.")
    flags.DEFINE_string("json", None, "Also write the whole comparison to this JSON file.")


def main(argv):
    """The command (see the module); returns its exit status."""
    import run as run_cli

    workdir = argv[1] if len(argv) == 2 else flags.FLAGS.workdir
    if len(argv) > 2 or workdir is None:
        raise app.UsageError("usage: credit_revalue.py WORKDIR --config=<the run's config> "
                             "--step N [--states 16 --continuations 32 --seed 7 --json out.json]")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    step = flags.FLAGS.step
    if step is None:
        raise app.UsageError("--step is required")
    try:
        from marl_jax import config as config_lib
        from marl_jax import config_check

        check_step(workdir, step)
        config = flags.FLAGS.config
        config_lib.resolve_size(config, overridden=config_lib.command_line_fields(sys.argv)[1])
        config_check.validate_config(
            config, config_file=run_cli._shown(flags.FLAGS["config"].config_filename))
        started = time.perf_counter()
        policy = restore_policy(config, workdir, step)
        with np.load(os.path.join(workdir, "credit", f"step_{step}.npz")) as saved:
            inputs = dict(saved)
        report = revalue(policy, inputs, states=flags.FLAGS.states,
                         continuations=flags.FLAGS.continuations, seed=flags.FLAGS.seed)
    except run_cli.INPUT_ERRORS as error:
        if flags.FLAGS.traceback or not run_cli.is_input_error(error):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    report.update(workdir=str(workdir), step=int(step), seconds=time.perf_counter() - started)
    print(table(report))
    print(f"{report['seconds']:.1f} s")
    if flags.FLAGS.json:
        with open(flags.FLAGS.json, "w") as f:
            json.dump(report, f, indent=1)
    return exit_status(report)


if __name__ == "__main__":
    define_flags()
    import run as run_cli

    app.run(main, flags_parser=run_cli.parse_flags)
