"""Arms x seeds of PPO / MA-PPO from one SFT policy and one reward model, vmapped.

An arm is a named set of overrides of `config.ppo` (`ARMS`). Everything arms may vary (lam,
gamma, kl_coef, ngram, termination, value weighting, reward aggregation, critic start) is traced,
so every (arm, seed) run of an experiment is one row of a single vmapped, jitted step: the same
prompts and sampling keys for every arm of a seed (paired comparisons), one compilation.

Rows in `<workdir>/metrics.jsonl`: training rows `{"stage": "ppo", "arm", "seed", "step", ...}`,
evaluation rows `{"stage": "eval", "arm", "seed", "step", "gold", "kl", "rm_score"}` every
`ppo.eval_every` steps on held-out prompts (step 0 is the SFT policy), and one
`{"stage": "final", "arm", "seed", "gold_per_prompt": [...], "rm_score_per_prompt": [...]}` per
run, and one of arm `sft` per seed (the SFT policy: the step-0 evaluation). The report (`marl_jax/eval/report.py`) is computed from these rows alone.
A training row's `perf/*` fields describe the group's whole vmapped step, all its runs
together (seconds per step, the tokens and model FLOPs of every run over it, the MFU of the
group), the same on each run's row; so do its `timing/<phase>_s` (rollout, score, advantages,
update: with `ppo.phase_timing` the step runs as the four vmapped phase programs, each waited
on; without, as one program and with no phase split) and `timing/eval_s` (the group's held-out
evaluation).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import config_check
from marl_jax import distributed, estimators
from marl_jax.data import batches
from marl_jax.data.real_tasks import decode_responses
from marl_jax.eval.report import SFT_ARM  # the SFT policy's final rows (step-0 evaluations)
from marl_jax.eval.report import instruction_set
from marl_jax.pipeline import Pipeline
from marl_jax.train import build, loop, perf, preemption, programs, sharding, turn_step
from marl_jax.train.metrics import status_line
from marl_jax.train.phased_step import PhaseClock
from marl_jax.train import ppo as ppo_lib
from marl_jax.train import phases, ppo_core as core
from marl_jax.train.ppo_types import Frozen, Models, PPOStatic, RunHparams, step_keys


# Token-level PPO: every macro field reset, whatever the base config says (n = 1 with any
# weighting or aggregation is token GAE exactly; these are the base values of the variant).
TOKEN_PPO = dict(ngram=1, termination="fixed", value_weighting="equal",
                 reward_aggregation="weighted")
CONTROL_SUFFIX = "_ctrl"

# name -> function of config.ppo returning overrides of config.ppo. Any macro arm `<arm>` also
# has its matched token-PPO control `<arm>_ctrl` (see `matched_control`).
ARMS = {
    "ppo": lambda p: dict(TOKEN_PPO),
    "ppo_lam1": lambda p: dict(TOKEN_PPO, lam=1.0),
    # MA-PPO as released: fixed n-grams, `equal` values, `weighted` (mean) rewards.
    "ma_ppo": lambda p: dict(ngram=p.ngram, termination="fixed", value_weighting="equal",
                             reward_aggregation="weighted"),
    # The semi-MDP choices: the value of the state where a macro starts, summed rewards.
    "ma_ppo_smdp": lambda p: dict(ngram=p.ngram, termination="fixed", value_weighting="first",
                                  reward_aggregation="sum"),
    # MA-PPO as released with macros that end at reasoning steps (a newline or a sentence end,
    # `ppo.step_delimiters`) instead of n-grams.
    "ma_ppo_step": lambda p: dict(termination="step", value_weighting="equal",
                                  reward_aggregation="weighted"),
    # Multi-turn: one macro per assistant turn (AReaL's turn-level GAE: the value where the turn
    # starts, its rewards summed).
    "ma_ppo_turn": lambda p: dict(ngram=1, termination="turn", value_weighting="first",
                                  reward_aggregation="sum"),
    # Ablations (configs/synthetic_sweep.py), relative to the base config's macro settings.
    "n3": lambda p: dict(ngram=3),
    "n5": lambda p: dict(ngram=5),
    "n10": lambda p: dict(ngram=10),
    "n_inf": lambda p: dict(ngram=p.response_length),
    "randomized": lambda p: dict(termination="randomized"),
    "perplexity": lambda p: dict(termination="perplexity"),
    # Macros that start at high-entropy "forking" tokens, or end after low-probability ones (SAE).
    "entropy": lambda p: dict(termination="entropy"),
    "low_probability": lambda p: dict(termination="low_probability"),
    "equal": lambda p: dict(value_weighting="equal"),
    "unit": lambda p: dict(value_weighting="unit"),
    "position": lambda p: dict(value_weighting="position"),
    "first": lambda p: dict(value_weighting="first"),
    "agg_weighted": lambda p: dict(reward_aggregation="weighted"),
    "agg_sum": lambda p: dict(reward_aggregation="sum"),
    "ma_ppo_lam1": lambda p: dict(lam=1.0),
    # The critic axis: the RM-initialised (rescaled) critic of every other arm vs a cold one.
    "ppo_cold_critic": lambda p: dict(TOKEN_PPO, critic_init="random"),
    "ma_ppo_cold_critic": lambda p: dict(critic_init="random"),
}
TRACED_FIELDS = ("lam", "gamma", "kl_coef", "ngram", "termination", "value_weighting",
                 "reward_aggregation", "critic_init")
# Fields that change the compiled step (the estimator, its loss, the batch shapes and the
# terminations' shares and thresholds): runs that differ in them are separate groups, each one
# vmapped program, run one after the other.
STATIC_FIELDS = ("estimator", "group_size", "batch_size", "mc_rollouts", "mc_branch_points",
                 "loss_aggregation", "ratio_level", "ratio_form", "cliprange_low",
                 "cliprange_high", "dual_clip", "dynamic_sampling_oversample", "overlong_buffer",
                 "overlong_penalty", "mask_truncated", "entropy_quantile",
                 "low_probability_quantile", "low_probability_threshold", "step_delimiters")
# Critic-free estimators (configs/synthetic_estimators.py), one arm each by the estimator's
# name (`estimators.ESTIMATORS`); sizes are set by the config.
ARMS.update({name: (lambda p, name=name: dict(TOKEN_PPO, estimator=name))
             for name, rules in estimators.ESTIMATORS.items()
             if not rules.needs_critic and not rules.branches})
ARMS.update({
    # Monte Carlo values at every token (VinePPO-like) or at the starts of 5-gram macros.
    "macro_mc_n1": lambda p: dict(TOKEN_PPO, estimator="macro_mc"),
    "macro_mc_n5": lambda p: dict(TOKEN_PPO, estimator="macro_mc", ngram=5),
    # A branch point at every 5-gram start: ceil(R / 5) slots hold all of them.
    "macro_mc_n5_all": lambda p: dict(TOKEN_PPO, estimator="macro_mc", ngram=5,
                                      mc_branch_points=-(-int(p.response_length) // 5)),
})
_GSPO = estimators.ESTIMATORS["gspo"]
ARMS.update({
    # The ratio's unit (configs/synthetic_objectives.py): the semi-MDP MA-PPO with one ratio
    # per macro action, clipped once with its advantage: the product of its tokens' ratios (the
    # paper's) or their geometric mean.
    "ma_ppo_smdp_macro_product": lambda p: dict(ARMS["ma_ppo_smdp"](p), ratio_level="macro",
                                                ratio_form="product"),
    "ma_ppo_smdp_macro_geometric": lambda p: dict(ARMS["ma_ppo_smdp"](p), ratio_level="macro",
                                                  ratio_form="geometric"),
    # Token PPO (GAE with the critic) with GSPO's ratio: one length-normalised ratio per
    # response, GSPO's clip ranges.
    "ppo_sequence_geometric": lambda p: dict(
        TOKEN_PPO, ratio_level=_GSPO.ratio_level, ratio_form=_GSPO.ratio_form,
        cliprange_low=_GSPO.clipranges[0], cliprange_high=_GSPO.clipranges[1]),
})


@dataclasses.dataclass(frozen=True)
class Run:
    arm: str
    seed: int
    ppo: dict  # the resolved ppo fields this run uses (TRACED_FIELDS, mean_macro_length)
    control_of: str = ""  # the macro arm this run is the matched control of

    @property
    def variant(self):
        return (self.ppo["termination"], self.ppo["value_weighting"],
                self.ppo["reward_aggregation"])

    @property
    def group(self) -> tuple:
        """The static fields of the run: runs of one group share one compiled step."""
        return tuple(self.ppo[k] for k in STATIC_FIELDS)


def is_known_arm(name: str) -> bool:
    """An arm of `ARMS`, or the matched control `<arm>_ctrl` of one."""
    return name in ARMS or (name.endswith(CONTROL_SUFFIX) and name[:-len(CONTROL_SUFFIX)] in ARMS)


def is_macro_arm(fields: dict) -> bool:
    """Macro-action PPO (GAE over macros): the arms that get a matched token-PPO control."""
    return estimators.ESTIMATORS[fields.get("estimator", "gae")].needs_critic and not (
        fields["termination"] == "fixed" and int(fields["ngram"]) == 1)


def known_macro_length(fields: dict, ppo_cfg):
    """L of a macro arm when it is known without rollouts: n for fixed n-grams shorter than the
    responses; None (measured on the arm's own rollouts) for the other terminations and on
    multi-turn trajectories (an environment's rewards), where turn boundaries cut n-grams."""
    if ppo_cfg.get("reward_source") == "env":
        return None
    if fields["termination"] == "fixed" and int(fields["ngram"]) < int(ppo_cfg.response_length):
        return float(fields["ngram"])
    return None


def matched_control(fields: dict, length: float) -> dict:
    """Token PPO with the hyper-parameters a macro arm implies: lam' = lam^(1/L) and, when the
    arm aggregates rewards with `weighted` (a mean over the macro), kl_coef / L; every other
    field (gamma, critic start, the policy objective) as the arm's, a macro ratio becoming the
    token's."""
    kl = fields["kl_coef"] / length if fields["reward_aggregation"] == "weighted" \
        else fields["kl_coef"]
    return without_macro_ratio(dict(fields, **TOKEN_PPO, lam=fields["lam"] ** (1.0 / length),
                                    kl_coef=kl, mean_macro_length=length))


def without_macro_ratio(fields: dict) -> dict:
    """`fields` with ratio_level "macro" made "token" where its macros are single tokens (fixed
    1-grams: token PPO, whatever the base config's ratio)."""
    if fields["ratio_level"] == "macro" and fields["termination"] == "fixed" \
            and int(fields["ngram"]) == 1:
        return dict(fields, ratio_level="token")
    return fields


def resolve_arm(name: str, ppo_cfg) -> dict:
    """The ppo fields of arm `name` (TRACED_FIELDS, plus `mean_macro_length` for macro arms and
    controls: None while it has to be measured)."""
    if name.endswith(CONTROL_SUFFIX) and name not in ARMS:
        base_name = name[:-len(CONTROL_SUFFIX)]
        base = resolve_arm(base_name, ppo_cfg)
        if not is_macro_arm(base):
            raise ValueError(f"config.experiment.arms: {name!r} is the control of {base_name!r}, "
                             "which is token PPO already; controls exist for macro arms only")
        if base["mean_macro_length"] is None:
            return without_macro_ratio(dict(base, **TOKEN_PPO, mean_macro_length=None))
        return matched_control(base, base["mean_macro_length"])
    if name not in ARMS:
        raise ValueError(f"config.experiment.arms: unknown arm {name!r}; known: {sorted(ARMS)} "
                         f"and <macro arm>{CONTROL_SUFFIX}")
    fields = {k: ppo_cfg[k] for k in TRACED_FIELDS + STATIC_FIELDS}
    fields = without_macro_ratio(dict(fields, **ARMS[name](ppo_cfg)))
    fields.update(dict(ppo_cfg.get("arm_overrides", {}).get(name, {})))
    if fields["ratio_level"] == "macro" and fields["termination"] == "fixed" \
            and int(fields["ngram"]) == 1:
        raise ValueError(f"arm {name!r}: ratio_level='macro' needs macro actions, but fixed "
                         "1-grams make every token its own macro: use token, or ngram > 1")
    if fields["termination"] == "parsing":
        raise ValueError(f"arm {name!r}: parsing termination runs host-side and cannot be "
                         "vmapped; run it as a single pipeline (--config.stage=all)")
    if int(fields["ngram"]) < 1:
        raise ValueError(f"arm {name!r}: ngram={fields['ngram']} must be >= 1")
    problem = config_check.termination_problem(fields, ppo_cfg.temperature)
    if problem:
        field = problem[0].split(".")[-1]
        raise ValueError(f"arm {name!r}: {field}={fields[field]!r}: {problem[1]}")
    problem = config_check.dynamic_sampling_problem(fields["estimator"],
                                                    fields["dynamic_sampling_oversample"])
    if problem:
        raise ValueError(f"arm {name!r}: {problem}")
    fields["mean_macro_length"] = known_macro_length(fields, ppo_cfg) if is_macro_arm(
        fields) else 1.0
    return fields


def experiment_arms(config) -> tuple:
    """`config.experiment.arms`, with `<arm>_ctrl` after every macro arm that lacks one when
    `config.experiment.add_controls` is set. A listed control whose arm is not macro GAE under
    this config (a critic-free `ppo.estimator` such as dapo or grpo: no lam and no per-token KL
    to match) is left out, with one line saying so."""
    arms = tuple(a for a in config.experiment.arms if not _control_without_macro_arm(a, config))
    if not config.experiment.get("add_controls", False):
        return arms
    out = []
    for arm in arms:
        out.append(arm)
        control = arm + CONTROL_SUFFIX
        if (not arm.endswith(CONTROL_SUFFIX) and control not in arms
                and is_macro_arm(resolve_arm(arm, config.ppo))):
            out.append(control)
    return tuple(out)


_DROPPED_CONTROLS = set()


def _control_without_macro_arm(arm: str, config) -> bool:
    """Whether `arm` is the control `<base>_ctrl` of a known arm with macro actions that a
    critic-free estimator trains without GAE here (a control of token PPO stays an error)."""
    base = arm[:-len(CONTROL_SUFFIX)]
    if not arm.endswith(CONTROL_SUFFIX) or arm in ARMS or base not in ARMS:
        return False
    fields = resolve_arm(base, config.ppo)
    if estimators.ESTIMATORS[fields.get("estimator", "gae")].needs_critic or (
            fields["termination"] == "fixed" and int(fields["ngram"]) == 1):
        return False
    if arm not in _DROPPED_CONTROLS and jax.process_index() == 0:
        _DROPPED_CONTROLS.add(arm)
        print(f"experiment: {arm} left out: {base} is not macro GAE with ppo.estimator="
              f"{config.ppo.estimator!r} (a matched control changes lam and the KL coefficient "
              "of GAE over macros)", flush=True)
    return True


def plan_runs(config) -> list[Run]:
    arms = experiment_arms(config)
    if not arms:
        raise ValueError("config.experiment.arms is empty")
    if len(set(arms)) != len(arms):
        raise ValueError(f"config.experiment.arms has duplicates: {arms}")
    overrides = dict(config.ppo.get("arm_overrides", None) or {})
    for arm, fields in overrides.items():  # an arm that is not run ignores its overrides
        if not is_known_arm(arm):
            raise ValueError(f"config.ppo.arm_overrides: unknown arm {arm!r}; known: "
                             f"{sorted(ARMS)} and <macro arm>{CONTROL_SUFFIX}")
        bad = sorted(set(dict(fields)) - set(TRACED_FIELDS + STATIC_FIELDS))
        if bad:
            raise ValueError(f"config.ppo.arm_overrides.{arm}: {bad} cannot vary between arms; "
                             f"an arm may set {TRACED_FIELDS + STATIC_FIELDS}")
    config_check.check_seeds(config.seeds)
    seeds = tuple(int(s) for s in config.seeds)
    runs = []
    for a in arms:
        control_of = a[:-len(CONTROL_SUFFIX)] if (a.endswith(CONTROL_SUFFIX)
                                                   and a not in ARMS) else ""
        runs += [Run(a, s, resolve_arm(a, config.ppo), control_of) for s in seeds]
    controls_of(runs, config)  # a bad config.experiment.controls fails before any training
    return runs


def controls_of(runs, config=None) -> dict:
    """arm -> the name of its matched control: `<arm>_ctrl` for the macro arms that have one,
    and the pairs of `config.experiment.controls` (e.g. a Monte Carlo macro arm and the
    token-level one with the same sampling cost)."""
    controls = {r.control_of: r.arm for r in runs if r.control_of}
    explicit = dict(config.experiment.get("controls", None) or {}) if config is not None else {}
    arms = list(dict.fromkeys(r.arm for r in runs))
    for arm, control in explicit.items():
        for role, name in (("arm", arm), ("control", control)):
            if not is_known_arm(name):
                raise ValueError(f"config.experiment.controls: unknown {role} {name!r} in "
                                 f"{arm!r} -> {control!r}; known: {sorted(ARMS)}")
        if arm not in arms or control not in arms:
            continue  # a pair is reported when both of its arms are run
        if arm == control:
            raise ValueError(f"config.experiment.controls: {arm!r} cannot be its own control")
        if controls.get(arm, control) != control:
            raise ValueError(f"config.experiment.controls: {arm!r} already has the control "
                             f"{controls[arm]!r}")
        controls[arm] = control
    return controls


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def run_experiment(config, workdir: str) -> dict:
    """SFT -> RM -> every (arm, seed) PPO run -> report. Returns the report dict.

    With `config.experiment.horizons`, the whole experiment is repeated for each number of
    summary items (a short and a long horizon) in `<workdir>/horizon_<items>/`, and
    `<workdir>/report.md` / `report.json` gather the per-horizon reports.
    """
    horizons = tuple(config.experiment.get("horizons", ()))
    if not horizons:
        return _run_one(config, workdir)
    from marl_jax.data.synthetic import SyntheticTask
    if config.task.name != "synthetic":
        raise ValueError("config.experiment.horizons applies to the synthetic task only")
    reports = {}
    for items in horizons:
        sub = config.copy_and_resolve_references()
        sub.task.summary_items = int(items)
        sub.task.doc_size = max(sub.task.doc_size, int(items))
        sub.experiment.horizons = ()
        longest = SyntheticTask(summary_items=int(items), max_description=sub.task.max_description,
                                doc_size=sub.task.doc_size).max_response_length
        sub.ppo.response_length = -(-longest // 8) * 8
        reports[f"horizon_{items}"] = _run_one(sub, os.path.join(workdir, f"horizon_{items}"))
    if jax.process_index() == 0:
        from marl_jax.eval import report as report_lib
        report_lib.write_combined(workdir, reports)
    return reports


def _run_one(config, workdir: str) -> dict:
    from marl_jax.eval import report as report_lib

    config_check.validate_config(config)
    runs = plan_runs(config)
    groups = run_groups(runs, config.experiment.get("runs_per_program", 0))
    pipe = Pipeline(config, workdir)
    try:
        sft_params = pipe.sft()
        rm_params, stats = pipe.rm()
        measured, step0 = [], {}
        for i, group in enumerate(groups):
            name = "experiment" if len(groups) == 1 else f"experiment_{i}"
            measured += _run_ppo_group(group_config(config, group[0]), pipe, group, sft_params,
                                       rm_params, stats, stage_name=name, step0=step0)
        if jax.process_index() == 0:
            order = {(r.arm, r.seed): i for i, r in enumerate(runs)}
            measured.sort(key=lambda r: order[(r.arm, r.seed)])
            pipe.writer.truncate_after("plan", -1)
            pipe.writer.write(plan_row(config, measured, len(pipe.task.eval["ids"])))
    finally:
        pipe.close()
    if jax.process_index() != 0:
        return {}
    if int(config.ppo.steps) == 0:  # nothing trained: the starting policy's evaluation alone
        summary = report_lib.write_starting_point(workdir)
        print(report_lib.starting_point_text(summary))
        return summary
    report = report_lib.write_report(workdir, beta=float(config.ppo.kl_coef),
                                     smoothing=int(config.experiment.smoothing),
                                     baseline="ppo", arms=experiment_arms(config))
    print(report_lib.summary_text(report))
    return report


def run_groups(runs, runs_per_program: int = 0) -> list[list[Run]]:
    """Runs split by their static fields, in the order their arms are listed; with
    `runs_per_program` > 0 each group is cut further into programs of at most that many runs
    (`config.experiment.runs_per_program`: one vmapped program holds every run's actor, critic
    and optimizer states, so a large model may fit only a run or two at a time)."""
    if not isinstance(runs_per_program, int) or runs_per_program < 0:
        raise ValueError(f"config.experiment.runs_per_program={runs_per_program!r}: must be an "
                         "int >= 0 (0: every run of a group in one program)")
    groups = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    if not runs_per_program:
        return list(groups.values())
    return [group[i:i + runs_per_program] for group in groups.values()
            for i in range(0, len(group), runs_per_program)]


def group_config(config, run: Run):
    """`config` with the static fields of `run`'s group (estimator, batch shapes) in its ppo
    section, validated."""
    out = config.copy_and_resolve_references()
    for key in STATIC_FIELDS:
        out.ppo[key] = run.ppo[key]
    config_check.validate_config(out)
    return out


@dataclasses.dataclass
class _GroupProgram:
    """One group's vmapped training step and its device inputs: the runs' stacked states
    (leading run axis), the frozen models, the traced hyper-parameters and the prompts."""
    static: PPOStatic
    mods: Models
    step_fn: object
    state: object
    state_sh: object
    frozen: Frozen
    hparams: RunHparams
    variants: tuple
    step_prompts: object  # step -> the runs' prompts of that step, sharded `[runs, B/G, P]`
    task_rl: dict = None  # the task's RL prompts (host arrays)
    phase_fns: dict | None = None  # `programs.experiment_phase_programs`, when phase-timed
    turns: object = None  # `_GroupTurns` of a multi-turn task, else None

    def step(self, state, step):
        if self.turns is not None:
            return self.turns.step(self, state, step)
        prompts = self.step_prompts(step)
        ids, mask, documents = prompts["ids"], prompts["mask"], prompts.get("documents")
        if self.phase_fns is None:
            return self.step_fn(state, self.frozen, self.hparams, ids, mask, documents)
        fns, frozen, clock = self.phase_fns, self.frozen, PhaseClock(timed=True)
        sample = clock.done("rollout", fns["rollout"](state, frozen, ids, mask))
        exp, roll_metrics = clock.done("score", fns["score"](state, frozen, ids, mask, sample,
                                                             documents))
        return self.learn(state, exp, roll_metrics, clock)

    def learn(self, state, exp, roll_metrics, clock):
        """The advantages and update phases on a scored rollout, timed by `clock`:
        (state, the step's metrics)."""
        fns, frozen = self.phase_fns, self.frozen
        adv, adv_metrics = clock.done("advantages", fns["advantages"](state, frozen,
                                                                      self.hparams, exp))
        state, metrics = clock.done("update", fns["update"](state, exp, adv, roll_metrics,
                                                            adv_metrics, frozen))
        return state, dict(metrics, **clock.seconds)


class _GroupTurns:
    """A multi-turn group's step: every run's actor plays the task's environment from the host
    (`turn_step.play_runs`), then the vmapped score (`experiment_trajectory_score_program`),
    advantages and update programs, timed as the phases are."""

    def __init__(self, config, task, static, mods, run_sh, frozen_sh, mesh, runs):
        self.player = turn_step.TrajectoryPlayer(config, task, static, mods.policy)
        self.score = programs.experiment_trajectory_score_program(static, mods, run_sh,
                                                                  frozen_sh, mesh).fn
        self.static, self.mesh = static, mesh
        self.seeds = [int(r.seed) for r in runs]
        self.task_rows = task.info["rl_rows"]
        self.rows = _step_rows(static, task, runs)

    def trajectories(self, program, state, step):
        """(prompt ids, prompt mask `[runs, B, P]`, trajectories `[runs, B, T]`), sharded."""
        k = self.static.group_size
        rows = np.repeat(self.rows(step), k, axis=1)
        prompts = {key: v[rows] for key, v in program.task_rl.items()}
        played = turn_step.play_runs(
            self.player, self.static, state, program.frozen, prompts["ids"], prompts["mask"],
            [[self.task_rows[i] for i in r] for r in rows], self.seeds, step)
        batch = sharding.shard_batch(dict(played, ids=prompts["ids"], mask=prompts["mask"]),
                                     self.mesh, axis=1)
        return batch["ids"], batch["mask"], {key: batch[key] for key in played}

    def step(self, program, state, step):
        clock = PhaseClock(timed=True)
        ids, mask, trajectory = self.trajectories(program, state, step)
        clock.done("rollout", None)
        exp, roll_metrics = clock.done("score", self.score(state, program.frozen, ids, mask,
                                                           trajectory))
        state, metrics = program.learn(state, exp, roll_metrics, clock)
        return state, dict(metrics, **self.player.episode_metrics)

    def macro_lengths(self, program):
        """`[runs]` tokens per macro of every run's first trajectories (its step 0's) under its
        own termination (`macro/len_avg` of the advantages phase)."""
        ids, mask, trajectory = self.trajectories(program, program.state, 0)
        exp, _ = self.score(program.state, program.frozen, ids, mask, trajectory)
        _, metrics = program.phase_fns["advantages"](program.state, program.frozen,
                                                     program.hparams, exp)
        return distributed.global_to_host(metrics["macro/len_avg"])


def _group_program(config, pipe, runs, sft_params, rm_params, stats) -> _GroupProgram:
    """Validates the group's batch shapes on the mesh, builds every run's critic and state, and
    compiles the vmapped step.

    Every input of the vmapped step is a global array on the mesh (on several processes a
    jitted computation cannot take host arrays): params and optimizer states with their logical
    shardings under a leading (replicated) run axis, prompts split over ("data", "fsdp") along
    their batch axis, hyper-parameters replicated.
    """
    p, task, mesh = config.ppo, pipe.task, pipe.mesh
    variants = tuple(sorted({r.variant for r in runs}))
    static = ppo_lib.static_from_config(config, task.tokenizer, variants=variants)
    mods = ppo_lib.make_models(config, pipe.policy, pipe.critic, pipe.reward_model, task.gold_fn)
    sharding.validate_batch(p.batch_size, mesh, "config.ppo.batch_size")
    ppo_lib.validate_decode_slots(config, mesh)
    if static.group_size > 1:
        sharding.validate_batch(static.prompts_per_step, mesh,
                                "config.ppo.batch_size / config.ppo.group_size (prompts per step)")
    critics = []
    for r in runs:
        critic_cfg = config.copy_and_resolve_references()
        critic_cfg.ppo.critic_init = r.ppo["critic_init"]
        critics.append(ppo_lib.initial_critic_params(
            critic_cfg, pipe.critic, sft_params, rm_params,
            jax.random.fold_in(jax.random.key(r.seed), 1), stats))
    static = ppo_lib.with_shared_trunk(static, pipe.policy.config.num_layers, sft_params,
                                       rm_params, critics)
    if static.shared_trunk_layers:
        status_line(f"[experiment] the actor, reference, critic and reward model share their "
                    f"bottom {static.shared_trunk_layers} layer(s), run once a step")
    run_sh = ppo_lib.state_shardings(mods, mesh, sft_params, critics[0])
    states = []
    for r, critic in zip(runs, critics):
        s = ppo_lib.initial_state(config, mods, sft_params,
                                  jax.device_put(critic, run_sh.critic_params), r.seed)
        states.append(s.replace(kl_coef=jnp.float32(r.ppo["kl_coef"])))
    frozen_sh = programs.frozen_shardings(mods, mesh, run_sh, rm_params)
    state_sh = jax.tree.map(programs.with_run_axis, run_sh)
    frozen = jax.device_put(ppo_lib.frozen_models(mods, sft_params, rm_params, stats),
                            frozen_sh)
    phase_fns = turns = None
    # A multi-turn group's rollout is played from the host: it always runs as its phases.
    if task.turn_callback is not None:
        turns = _GroupTurns(config, task, static, mods, run_sh, frozen_sh, mesh, runs)
    if p.get("phase_timing", True) or turns is not None:
        phase_fns = {name: program.fn for name, program in programs.experiment_phase_programs(
            static, mods, run_sh, frozen_sh, mesh).items()}
    return _GroupProgram(
        static=static, mods=mods, phase_fns=phase_fns, turns=turns, task_rl=task.rl,
        step_fn=programs.experiment_step_program(static, mods, run_sh, frozen_sh, mesh).fn,
        state=jax.device_put(_stack(states), state_sh), state_sh=state_sh, frozen=frozen,
        hparams=jax.device_put(_run_hparams(runs, variants), sharding.replicated(mesh)),
        variants=variants, step_prompts=_step_prompts(static, task, mesh, runs))


def _step_rows(static, task, runs):
    """step -> `[runs, B/G]` every run's RL prompt rows of that step (run r draws with seed
    r.seed + 2), as `_step_prompts` draws them."""
    seeds = [int(r.seed) for r in runs]
    num_prompts = len(task.rl["ids"])
    return lambda step: np.stack([batches.batch_indices(num_prompts, static.prompts_per_step,
                                                        s + 2, step) for s in seeds])


def _step_prompts(static, task, mesh, runs):
    """step -> every run's RL prompts of that step (run r draws with seed r.seed + 2; this
    process's rows of each), sharded along the batch axis."""
    seeds = [int(r.seed) for r in runs]
    num_prompts = len(task.rl["ids"])
    local_rows = distributed.local_batch_rows(static.prompts_per_step,
                                              sharding.batch_sharding(mesh))

    def step_prompts(step):
        rows = np.stack([batches.batch_indices(num_prompts, static.prompts_per_step, s + 2, step)
                         for s in seeds])[:, local_rows]
        return sharding.shard_batch({k: v[rows] for k, v in task.rl.items()}, mesh, axis=1)

    return step_prompts


def _measure_macro_lengths(config, program: _GroupProgram, runs, mesh):
    """Runs whose `mean_macro_length` is unset get the one measured on their first batch (the
    SFT policy's responses); returns the runs and the program with their hparams and KL
    coefficients (which the length scales) updated."""
    if all(r.ppo["mean_macro_length"] is not None for r in runs):
        return runs, program
    if program.turns is not None:
        return _with_lengths(config, program, runs, program.turns.macro_lengths(program), mesh)
    measure = jax.jit(jax.vmap(functools.partial(_mean_macro_length_at_start, program.static,
                                                 program.mods),
                               in_axes=(0, None, 0, 0, 0, 0)))
    prompts = program.step_prompts(0)
    lengths = distributed.global_to_host(measure(
        program.state, program.frozen, program.hparams, prompts["ids"], prompts["mask"],
        prompts.get("documents")))
    return _with_lengths(config, program, runs, lengths, mesh)


def _with_lengths(config, program: _GroupProgram, runs, lengths, mesh):
    """(runs, program) with the measured mean macro lengths `[runs]` filled in, and the
    program's hparams and KL coefficients (which the lengths scale) updated."""
    runs = _with_measured_lengths(config, runs, [float(x) for x in lengths])
    state = program.state.replace(kl_coef=jax.device_put(
        jnp.asarray([r.ppo["kl_coef"] for r in runs], jnp.float32), program.state_sh.kl_coef))
    return runs, dataclasses.replace(
        program, state=state,
        hparams=jax.device_put(_run_hparams(runs, program.variants), sharding.replicated(mesh)))


class _GroupEvaluator:
    """The held-out evaluation of every run of a group (one vmapped call: each run's actor on
    the same prompts, with its seed's keys) and its `eval` rows."""

    def __init__(self, config, pipe, runs, program: _GroupProgram):
        task, mesh = pipe.task, pipe.mesh
        self.runs, self.task = runs, task
        self.m = int(config.ppo.eval_samples_per_prompt)  # responses per held-out prompt
        self.fn = jax.jit(jax.vmap(functools.partial(
            ppo_lib.evaluate_from_key_data, program.static, program.mods, gold_fn=task.gold_fn,
            samples_per_prompt=self.m), in_axes=(0, None, None, None, None, 0)))
        self.frozen = program.frozen
        self.trajectories = None if task.turn_callback is None else \
            turn_step.TrajectoryEvaluation(config, task, program.static, program.mods)
        self.inputs = sharding.put_global(task.eval, mesh)
        self.keys = sharding.put_global(np.stack([
            jax.random.key_data(jax.random.fold_in(jax.random.key(int(r.seed)), 7))
            for r in runs]), mesh, axis=None)
        # A gold computed on the host from decoded text (the review task) instead of on device.
        self.text_gold = task.eval_gold
        self.fetched = ppo_lib.EVAL_ROW_KEYS + (
            ("response_ids", "response_mask") if self.text_gold else ())
        self.train_s = 0.0  # the group's training time so far, shared by its runs
        self.latest_step, self.latest = None, None  # the last evaluation (final rows reuse it)

    def evaluate(self, state) -> dict:
        """Per-prompt results `[runs, E]` of the runs' current actors (`EVAL_ROW_KEYS`)."""
        # One call with no steps to report: a line before and after it (minutes on a CPU).
        start = time.monotonic()
        n = len(self.task.eval["ids"])
        status_line(f"[eval] {n * self.m * len(self.runs)} held-out responses "
                    f"({len(self.runs)} run(s) x {n} prompts x {self.m}): sampling and scoring")
        if self.trajectories is not None:
            # Each run plays the held-out episodes with its own actor and its seed's key.
            runs = [self.trajectories.results(
                jax.tree.map(lambda x, i=i: x[i], state.actor_params), self.frozen,
                jax.random.fold_in(jax.random.key(int(r.seed)), 7))
                for i, r in enumerate(self.runs)]
            status_line(f"[eval] done in {time.monotonic() - start:.0f} s")
            return {k: np.stack([x[k] for x in runs]) for k in ppo_lib.EVAL_ROW_KEYS}
        result = self.fn(state.actor_params, self.frozen, self.inputs["ids"],
                         self.inputs["mask"], self.inputs.get("documents"), self.keys)
        result = distributed.global_to_host({k: v for k, v in result.items()
                                             if k in self.fetched})
        if self.text_gold is not None:
            result["gold"] = host_gold_per_prompt(
                self.text_gold, functools.partial(decode_responses, self.task.tokenizer),
                result.pop("response_ids"), result.pop("response_mask"), self.m)
        status_line(f"[eval] done in {time.monotonic() - start:.0f} s")
        return result

    def rows(self, state, step, result=None) -> list[dict]:
        """The `eval` rows of every run at `step` (evaluating now unless `result` is given)."""
        result = self.evaluate(state) if result is None else result
        self.latest_step, self.latest = step, result
        budget = distributed.global_to_host(
            {"generated_tokens": state.generated_tokens, "prefill_tokens": state.prefill_tokens})
        return [dict(stage="eval", arm=r.arm, seed=r.seed, step=step,
                     **ppo_lib.eval_row({k: v[i] for k, v in result.items()}),
                     generated_tokens=float(budget["generated_tokens"][i]),
                     prefill_tokens=float(budget["prefill_tokens"][i]),
                     train_s=self.train_s / len(self.runs))
                for i, r in enumerate(self.runs)]


def _write_step0(pipe, writer, evaluator: _GroupEvaluator, state, runs, step0):
    """A fresh group's step-0 `eval` rows (the SFT policy, reused from `step0` when every seed
    of the group has one), and the `final` row of arm `sft` of each seed evaluated here."""
    for name in ("eval", "final"):
        writer.truncate_after(name, -1)
    cached = [step0.get(r.seed) for r in runs]
    if all(c is not None for c in cached):
        result = {k: np.stack([c[k] for c in cached]) for k in cached[0]}
    else:
        result = evaluator.evaluate(state)
    for row in evaluator.rows(state, 0, result):
        pipe.writer.write(row)
    for i, r in enumerate(runs):
        if r.seed not in step0:
            step0[r.seed] = {k: v[i] for k, v in result.items()}
            pipe.writer.truncate_after("final", -1, arm=SFT_ARM, seed=r.seed)
            pipe.writer.write(final_row(SFT_ARM, r.seed, 0, result, i))


def _write_finals(pipe, evaluator: _GroupEvaluator, state, runs, steps: int):
    """The `final` row of every run that has none yet (the last evaluation's when it was at
    `steps`). Process 0 alone reads metrics.jsonl; its answer decides for all, since the
    evaluation is a collective."""
    finished = {(r.get("arm"), r.get("seed")) for r in _read(pipe.workdir)
                if r.get("stage") == "final"}
    if distributed.main_process_value(all((r.arm, r.seed) in finished for r in runs)):
        return
    result = evaluator.latest if evaluator.latest_step == steps else evaluator.evaluate(state)
    for i, r in enumerate(runs):
        if (r.arm, r.seed) not in finished:
            pipe.writer.write(final_row(r.arm, r.seed, steps, result, i))


def _run_ppo_group(config, pipe, runs, sft_params, rm_params, stats, *, stage_name="experiment",
                   step0=None):
    """One group of runs (same static fields) as one vmapped step, resumable; returns the runs
    with their measured mean macro lengths.

    `step0` (seed -> per-prompt results, shared by the groups of one experiment) holds the
    step-0 evaluations: the SFT policy on a seed's held-out prompts and keys, the same for every
    run of the seed, so a later group reuses them. The first evaluation of a seed is also
    written as its `final` row of arm `sft`.
    """
    program = _group_program(config, pipe, runs, sft_params, rm_params, stats)
    # Every program of the group is traced under the mesh and its logical rules, so the models'
    # activation constraints split each run's batch over the data-parallel devices (without
    # them the update's row shuffle leaves every device computing every row).
    with sharding.mesh_context(pipe.mesh, sharding.logical_rules(
            pipe.mesh, build.model_dims(pipe.policy.config))):
        return _train_group(config, pipe, runs, program, stage_name,
                            {} if step0 is None else step0)


def _train_group(config, pipe, runs, program: _GroupProgram, stage_name: str, step0: dict):
    """`_run_ppo_group`'s measurement, evaluations and steps of a built group program."""
    p = config.ppo
    runs, program = _measure_macro_lengths(config, program, runs, pipe.mesh)
    evaluator = _GroupEvaluator(config, pipe, runs, program)
    writer = _PerRunWriter(pipe.writer, runs)
    stage = loop.Stage(stage_name, pipe.workdir, max_to_keep=config.max_to_keep)
    if not stage.latest_step():
        preemption.safe_point(f"before the step-0 evaluation of {stage_name}")
        _write_step0(pipe, writer, evaluator, program.state, runs, step0)

    last = {"t": None}
    evaluates = loop.evaluation_steps(p.eval_every, p.steps)

    def hooks(state, done):
        now = time.perf_counter()
        if last["t"] is not None:
            evaluator.train_s += now - last["t"]
        out = []
        if evaluates(done):
            out = evaluator.rows(state, done)
        last["t"] = time.perf_counter()
        return out

    metadata = dict(stage="experiment", config=config.to_dict(),
                    runs=[dict(arm=r.arm, seed=r.seed, **r.ppo) for r in runs])
    last["t"] = time.perf_counter()
    state, _ = loop.run(stage, state=program.state, total_steps=p.steps, step_fn=program.step,
                        writer=writer, metadata=metadata,
                        checkpoint_every=config.checkpoint_every, log_every=config.log_every,
                        progress_keys=("objective/scores", "objective/kl"), hooks=hooks,
                        hooks_due=evaluates, truncate_stages=("ppo", "eval"),
                        cost=ppo_lib.step_cost(program.static, program.mods,
                                               pipe.task.prompt_length),
                        peak_flops=perf.devices_peak_flops(pipe.policy.config.dtype,
                                                        pipe.policy.config.precision))
    _write_finals(pipe, evaluator, state, runs, int(p.steps))
    stage.close()
    preemption.safe_point(f"after the final evaluations of {stage_name}")
    return runs


def host_gold_per_prompt(text_gold, decode, response_ids, response_mask,
                         samples_per_prompt: int) -> np.ndarray:
    """`[runs, E]` gold of each run's held-out prompts from its responses `[runs, E m, R]`
    (row e m + j: sample j of prompt e, as `ppo.evaluate` samples them): the mean over a
    prompt's m samples of `text_gold(texts [E] in held-out order)`, the texts from
    `decode(ids [E, R], mask [E, R])`."""
    m = int(samples_per_prompt)
    return np.stack([np.mean([
        np.asarray(text_gold(decode(ids[j::m], mask[j::m]))) for j in range(m)], axis=0)
        for ids, mask in zip(np.asarray(response_ids), np.asarray(response_mask))])


def final_row(arm: str, seed: int, step: int, result: dict, i: int) -> dict:
    """The `final` row of run `i` of an evaluation `result` (per-prompt values `[runs, E]`)."""
    row = dict(stage="final", arm=arm, seed=seed, step=step,
               rm_score_per_prompt=[float(x) for x in result["rm_score"][i]],
               kl_per_prompt=[float(x) for x in result["kl"][i]])
    if "gold" in result:
        row["gold_per_prompt"] = [float(x) for x in result["gold"][i]]
    return row



def plan_row(config, runs, num_eval_prompts: int) -> dict:
    """The `plan` row of metrics.jsonl: what the report needs to know about the experiment
    besides the evaluation rows (arms in order, seeds, the baseline, beta for J, which arm
    controls which, every run's resolved settings)."""
    arms = list(dict.fromkeys(r.arm for r in runs))
    first = {}
    for r in runs:
        first.setdefault(r.arm, r.ppo)
    return dict(
        stage="plan", step=0, arms=arms, seeds=list(dict.fromkeys(r.seed for r in runs)),
        baseline="ppo", beta=float(config.ppo.kl_coef), controls=controls_of(runs, config),
        macro_arms=[a for a in arms if is_macro_arm(first[a])], runs=first,
        per_run=[dict(arm=r.arm, seed=r.seed, **r.ppo) for r in runs],
        steps=int(config.ppo.steps), eval_every=int(config.ppo.eval_every),
        num_eval_prompts=int(num_eval_prompts),
        eval_samples_per_prompt=int(config.ppo.eval_samples_per_prompt),
        instruction_set=instruction_set())


def _run_hparams(runs, variants) -> RunHparams:
    return _stack([RunHparams(
        lam=jnp.float32(r.ppo["lam"]), gamma=jnp.float32(r.ppo["gamma"]),
        ngram=jnp.int32(r.ppo["ngram"]), variant=jnp.int32(variants.index(r.variant)))
        for r in runs])


def _mean_macro_length_at_start(static, mods, state, frozen, hparams, prompt_ids, prompt_mask,
                                documents):
    """Tokens per macro of a run's first rollout (the SFT policy's, on its step-0 prompts and
    keys: exactly what the run sees at step 0), under the run's own termination."""
    exp, _ = core.rollout_phase(static, mods, state, frozen, prompt_ids, prompt_mask, documents)
    _, k_segment, _ = step_keys(state)
    segments = phases.advantages.segment_ids_for(static, hparams, exp, k_segment)
    return phases.advantages.segment_stats(segments, hparams.variant, static, exp.response_mask)[
        "macro/len_avg"]


def _with_measured_lengths(config, runs, lengths):
    """Runs whose mean macro length had to be measured, with it filled in: a macro arm records
    its own; its control takes the arm's of the same seed (lam^(1/L), kl_coef / L)."""
    measured = {(r.arm, r.seed): length for r, length in zip(runs, lengths)}
    out = []
    for r in runs:
        if r.ppo["mean_macro_length"] is not None:
            out.append(r)
        elif r.control_of:
            base = dict(resolve_arm(r.control_of, config.ppo))
            out.append(dataclasses.replace(r, ppo=matched_control(
                base, measured[(r.control_of, r.seed)])))
        else:
            out.append(dataclasses.replace(r, ppo=dict(r.ppo, mean_macro_length=measured[
                (r.arm, r.seed)])))
    return out


def _read(workdir):
    from marl_jax.train.metrics import read_metrics
    return read_metrics(workdir)


class _PerRunWriter:
    """Splits the vmapped step's rows (a leading run axis on every metric) into one row per run."""

    def __init__(self, writer, runs):
        self.writer, self.runs = writer, runs

    def write(self, row):
        if not str(row.get("stage", "")).startswith("experiment"):
            self.writer.write(row)
            return
        for i, r in enumerate(self.runs):
            one = {k: (v[i] if isinstance(v, list) else v) for k, v in row.items()}
            one.update(stage="ppo", arm=r.arm, seed=r.seed)
            self.writer.write(one)

    def truncate_after(self, stage, step, **match):
        """Drops this group's rows only, by (arm, seed): other groups of the experiment, the
        other seeds of an arm among them, keep theirs."""
        if str(stage).startswith("experiment"):
            stage = "ppo"
        return sum(self.writer.truncate_after(stage, step, **dict(match, arm=r.arm, seed=r.seed))
                   for r in self.runs)
