"""Every estimator record and ratio level on every path a run takes.

The paths: `stage=ppo` (`ppo.run_ppo`: one fused program, or the four phase programs with
`ppo.phase_timing`), the experiment runner (`experiment.run_experiment`: the vmapped step, or
the vmapped phases) and the AOT programs `bench.py memory` compiles (`aot.ppo_programs`). Each
case trains two steps of the tests' tiny config on the experiment runner, phase-timed (the
default); the cases whose fused step differs in kind (`STAGE_FUSED`: each ratio level, a KL
loss term, Monte Carlo branches, dynamic sampling) also fused, and on `stage=ppo` both ways,
and the two must give the same training metrics to the bit (the other records differ from
those in their advantage function alone); the AOT programs of each case must lower with the
shardings they declare.

The cases are every record at its published ratio level, and every ratio level (token,
macro, sequence) with a critic (GAE) and without one (a group record whose KL is a loss term).
A new record, ratio level or path joins the matrix by one entry of `CASES`.
"""
import shutil
import sys

import jax
import numpy as np
import pytest

from marl_jax import experiment, stages
from marl_jax.train import build, compile_cache, sharding
from marl_jax.train.metrics import read_metrics

from train_util import ROOT, tiny_config

sys.path.insert(0, str(ROOT / "experiments"))
import bench_memory  # noqa: E402

# name -> the ppo fields of the case over token PPO (`experiment.TOKEN_PPO`); on the
# experiment runner it is an arm of that name.
CASES = {
    "ppo": {},
    "ma_ppo_macro": dict(ngram=3, ratio_level="macro", ratio_form="product"),
    "ppo_sequence": dict(ratio_level="sequence", ratio_form="product"),
    "grpo": dict(estimator="grpo", group_size=2),
    "grpo_macro": dict(estimator="grpo", group_size=2, ngram=3, ratio_level="macro",
                       loss_aggregation="token_mean"),
    "dr_grpo": dict(estimator="dr_grpo", group_size=2),
    "rloo": dict(estimator="rloo", group_size=2),
    "reinforce_pp": dict(estimator="reinforce_pp"),
    "macro_mc": dict(estimator="macro_mc", ngram=3, mc_rollouts=2, mc_branch_points=2),
    "gspo": dict(estimator="gspo", group_size=2),
    "dapo": dict(estimator="dapo", group_size=2),
    "turn_rloo": dict(estimator="turn_rloo", group_size=2),
    "turn_grpo": dict(estimator="turn_grpo", group_size=2),
    # Macros at reasoning steps: here the synthetic summaries' items, which ";" ends.
    "ma_ppo_step": dict(termination="step", step_delimiters=(";",)),
}
# The matrix's shared settings: two minibatches, so every schedule is more than one update;
# 16 rows, so a group record's prompts (8) split over the 8 test devices.
BASE = {"ppo.steps": 2, "ppo.batch_size": 16, "ppo.eval_every": 2, "ppo.num_minibatches": 2,
        "checkpoint_every": 1}
TIMINGS = (True, False)
# The cases whose two timings are not equal to the bit, and the float32 rounding allowed
# (rtol, atol): XLA fuses the Monte Carlo values' means, and dynamic sampling's gathered rows,
# into their neighbours differently inside the fused step, so their sums round differently.
ROUNDING = {"macro_mc": (2e-5, 1e-6), "dapo": (2e-5, 1e-6)}


def _fields(case: str) -> dict:
    return dict(experiment.TOKEN_PPO, **CASES[case])


def _config(stage: str, timed: bool, **fields):
    cfg = tiny_config(**{"stage": stage, "ppo.phase_timing": timed, **BASE,
                         **{f"ppo.{k}": v for k, v in fields.items()}})
    cfg.seeds = (0,)
    return cfg


@pytest.fixture(scope="module", autouse=True)
def every_program_cached():
    """What the runs share compiles once (the evaluation, the sampler, a record's score and
    advantages under every ratio level): the persistent cache keeps every program, however
    fast it compiled."""
    compile_cache.use_run_cache()
    previous = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", previous)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A workdir whose SFT and reward-model stages are done: every run below starts from a
    copy of it, as a second command in the same workdir would."""
    workdir = tmp_path_factory.mktemp("paths") / "trained"
    for stage in ("sft", "rm"):
        stages.run(_config(stage, True), str(workdir))
    return workdir


def _training_rows(workdir, keys=("step",)):
    return {tuple(r[k] for k in keys): r for r in read_metrics(str(workdir))
            if r.get("stage") == "ppo"}


def _assert_same_training_metrics(timed_rows, fused_rows, label):
    rounding = ROUNDING.get(label)
    assert sorted(timed_rows) == sorted(fused_rows) and timed_rows, label
    for key, timed in timed_rows.items():
        fused = fused_rows[key]
        phases = sorted(k for k in timed if k.startswith("timing/") and k != "timing/eval_s")
        assert phases == [f"timing/{p}_s" for p in ("advantages", "rollout", "score",
                                                     "update")], (label, phases)
        assert not [k for k in fused if k.startswith("timing/") and k != "timing/eval_s"]
        fields = sorted(k for k in timed if not k.startswith(("perf/", "timing/")))
        assert fields == sorted(k for k in fused if not k.startswith(("perf/", "timing/")))
        for k in fields:
            if isinstance(timed[k], str) or rounding is None:
                assert timed[k] == fused[k] or np.array_equal(timed[k], fused[k],
                                                              equal_nan=True), (
                    label, key, k, timed[k], fused[k])
            else:
                np.testing.assert_allclose(timed[k], fused[k], *rounding,
                                           err_msg=f"{label} {key} {k}")


def _run_copy(trained, workdir, cfg):
    shutil.copytree(trained, workdir)
    stages.run(cfg, str(workdir))
    return workdir


# On `stage=ppo` both timings run where the single run's fused step differs in kind: each ratio
# level, a critic-free record with its KL loss term, Monte Carlo branches and dynamic sampling.
# The other records differ from these in their advantage function alone, which the programs of
# both runners share: they run phase-timed on the experiment runner, whose phases are
# `stage=ppo`'s vmapped over runs; `stage=ppo` runs the step termination too (its table is
# built on the host).
STAGE_FUSED = ("ppo", "ma_ppo_macro", "ppo_sequence", "grpo", "macro_mc", "dapo")
STAGE_CASES = STAGE_FUSED + ("ma_ppo_step",)


@pytest.mark.parametrize("case", STAGE_CASES)
def test_stage_ppo_phase_timed_and_fused_give_the_same_metrics(case, trained, tmp_path):
    timings = TIMINGS if case in STAGE_FUSED else (True,)
    rows = {timed: _training_rows(_run_copy(trained, tmp_path / str(timed),
                                            _config("ppo", timed, **_fields(case))))
            for timed in timings}
    if case in STAGE_FUSED:
        _assert_same_training_metrics(rows[True], rows[False], case)
    assert sorted(rows[True]) == [(1,), (2,)]
    _assert_the_case_ran(case, rows[True])


@pytest.fixture(scope="module")
def experiment_rows(trained, tmp_path_factory):
    """Every case as an arm of one experiment (each its own group: one compiled program per
    case, vmapped over two seeds), run phase-timed (the default) from a copy of `trained`; the
    cases whose fused step differs in kind (`STAGE_FUSED`) also fused, from another copy:
    timing -> {(arm, seed, step): row}."""
    arms = {name: (lambda p, name=name: _fields(name)) for name in CASES}
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(experiment, "ARMS", dict(experiment.ARMS, **arms))
        for timed in TIMINGS:
            cfg = _config("experiment", timed)
            cfg.seeds = (0, 1)  # two runs in each vmapped program
            cfg.experiment.arms = tuple(CASES) if timed else STAGE_FUSED
            cfg.experiment.add_controls = False
            workdir = _run_copy(trained, tmp_path_factory.mktemp("experiment") / str(timed), cfg)
            out[timed] = _training_rows(workdir, keys=("arm", "seed", "step"))
    return out


@pytest.mark.parametrize("case", CASES)
def test_experiment_phase_timed_and_fused_give_the_same_metrics(case, experiment_rows):
    rows = {timed: {k: r for k, r in experiment_rows[timed].items() if k[0] == case}
            for timed in TIMINGS}
    if case in STAGE_FUSED:
        _assert_same_training_metrics(rows[True], rows[False], case)
    else:
        assert not rows[False], case
    assert sorted(rows[True]) == [(case, s, t) for s in (0, 1) for t in (1, 2)]
    _assert_the_case_ran(case, rows[True])


def _assert_the_case_ran(case, rows):
    """The rows are the case's own: its estimator's and its ratio level's fields."""
    fields = _fields(case)
    last = rows[max(rows)]
    assert ("loss/value_avg" in last) == (fields.get("estimator", "gae") == "gae"), case
    assert ("loss/kl_avg" in last) == (fields.get("estimator") in ("grpo", "dr_grpo")), case
    assert ("policy/ratio_units_avg" in last) == (fields.get("ratio_level") == "macro"), case
    assert (np.min(last["macro/len_avg"]) > 1) == (
        fields["termination"] != "fixed" or fields["ngram"] > 1), case
    if fields.get("estimator") == "dapo":
        # Dynamic sampling: three times the trained groups sampled, all counted in the budget.
        assert "dynamic/groups_trained" in last and "overlong/penalty_mean" in last
        assert np.all(np.asarray(last["budget/generated_tokens"]) > np.asarray(
            last["val/response_length"]) * 8), case
    if fields.get("estimator") == "macro_mc":
        assert np.all(np.asarray(last["budget/branch_generated_tokens"]) > 0), case


@pytest.mark.parametrize("case", CASES)
def test_aot_programs_lower_with_their_shardings(case, monkeypatch):
    """The programs `bench.py memory` compiles for the case (a run's generate, score, rollout,
    update and fused step; the experiment's vmapped step and phases) lower with the shardings
    they declare, and the experience passed between programs holds row-split leaves only."""
    monkeypatch.setattr(experiment, "ARMS", dict(experiment.ARMS, **{
        case: lambda p: _fields(case)}))
    cfg = _config("ppo", True, **_fields(case))
    cfg.experiment.arms, cfg.experiment.add_controls = (case,), False
    mesh = sharding.make_mesh(cfg.mesh)
    model, _, token_ids = bench_memory.resolve_model(cfg, "cpu")
    # The programs an experience enters or leaves (the fused ones keep it inside).
    wanted = {"score", "update", "experiment_phases"}
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, build.model_dims(model))):
        entries = bench_memory.stage_programs(cfg, model, token_ids, mesh, wanted)
        names = [name for name, *_ in entries]
        assert sorted(names) == sorted({"score", "update", *bench_memory.EXPERIMENT_PHASES})
        for name, program, args, *_ in entries:
            assert program.fn.lower(*args).as_text(), name
        score, args = next((e[1], e[2]) for e in entries if e[0] == "score")
        exp = jax.eval_shape(score.fn, *args)[0]
    assert {leaf.shape[0] for leaf in jax.tree.leaves(exp)} == {cfg.ppo.batch_size}, case
