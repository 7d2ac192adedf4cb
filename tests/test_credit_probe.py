"""The advantage-quality probe of a PPO run (`config.credit`, marl_jax/credit/probe.py), the
study's report (experiments/credit_report.py) and the probe's states valued again
(experiments/credit_revalue.py, marl_jax/credit/recheck.py), on one tiny run of the tests'
pipeline: what a probe saves is scored as numpy computes it by hand, its draws are the run's
own (no draw shared with a run of another seed), a prompt that pooled runs share is one
bootstrap unit, a rule is "best" only by paired differences, fresh continuations of the
restored policy agree with what the probe saved, and a shifted truth is caught."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import macro_oracle
import numpy as np
import pytest
from train_util import ROOT, tiny_config, tiny_flags

from marl_jax import stages
from marl_jax.config_check import validate_config
from marl_jax.credit import probe as credit
from marl_jax.credit import probe_scores
from marl_jax.credit import truth as credit_truth
from marl_jax.train.metrics import read_metrics
from marl_jax.train.turn_step import episode_seeds

sys.path.insert(0, str(ROOT / "experiments"))
import credit_report
import credit_revalue

CREDIT = {"credit.every": 1, "credit.prompts": 3, "credit.group_size": 2,
          "credit.continuations": 8, "credit.chunk_states": 64,
          "credit.rules": ("fixed", "low_probability"), "credit.weightings": ("equal",),
          "credit.mc_rollouts": 2}
# Checkpointed at every step: the policy of each probe can be restored.
RUN = {"ppo.steps": 1, "ppo.eval_every": 0, "checkpoint_every": 1, "max_to_keep": 3, **CREDIT}
# The states valued again: drawn tokens, fresh continuations per state, their seed.
SIZES = {"states": 10, "continuations": 32, "seed": 7}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """A one-step PPO run probed and checkpointed at steps 0 and 1: (workdir, credit rows by
    step)."""
    workdir = tmp_path_factory.mktemp("credit") / "run"
    stages.run(tiny_config(**RUN), str(workdir))
    rows = {r["step"]: r for r in read_metrics(str(workdir)) if r["stage"] == "credit"}
    return workdir, rows


@pytest.fixture(scope="module")
def restored(probed):
    """The policy of the run's probe at step 1, restored, and that probe's saved inputs."""
    workdir, _ = probed
    return credit_revalue.restore_policy(tiny_config(**RUN), str(workdir), 1), _load(workdir, 1)


def _load(workdir, step):
    return dict(np.load(workdir / "credit" / f"step_{step}.npz"))


def _states(inputs):
    """(row, position) -> index of the probe's saved states."""
    return {(int(b), int(t)): i for i, (b, t) in enumerate(zip(inputs["state_rows"],
                                                               inputs["state_positions"]))}


def test_probe_scores_equal_numpy_on_its_saved_inputs(probed):
    workdir, rows = probed
    assert sorted(rows) == [0, 1]
    for step, row in rows.items():
        x = _load(workdir, step)
        mask = x["response_mask"]
        lengths = np.cumprod(mask != 0, axis=1).sum(axis=1)
        # Every state of every response was valued: positions 0..L_b, the terminal one 0.
        states = _states(x)
        assert sorted(states) == sorted((b, t) for b in range(mask.shape[0])
                                        for t in range(lengths[b] + 1) if lengths[b])
        v = x["state_mean"]
        terminal = [states[(b, int(lengths[b]))] for b in range(mask.shape[0]) if lengths[b]]
        assert np.all(v[terminal] == 0) and np.all(x["state_se"][terminal] == 0)
        gamma, lam = float(x["gamma"]), float(x["lam"])
        truth, token_gae, control = [], [], []
        num_macros = sum(len(np.unique(x["segments/fixed"][b, :lengths[b]]))
                         for b in range(mask.shape[0]))
        macro_length = mask.sum() / num_macros
        for b in range(mask.shape[0]):
            n = int(lengths[b])
            truth += [x["rewards"][b, t] + gamma * v[states[(b, t + 1)]] - v[states[(b, t)]]
                      for t in range(n)]
            token_gae.append(macro_oracle.gae_row(x["values"][b], x["rewards"][b], n, gamma, lam))
            control.append(macro_oracle.gae_row(x["values"][b], x["rewards"][b], n, gamma,
                                                lam ** (1 / macro_length)))
            # The estimators' advantages as the probe saved them.
            np.testing.assert_allclose(x["advantages/token_gae"][b, :n], token_gae[-1],
                                       rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(x["advantages/control/fixed"][b, :n], control[-1],
                                       rtol=1e-4, atol=1e-5)
        truth = np.array(truth)
        for name in ("token_gae", "control/fixed", "macro_gae/fixed/equal", "grpo", "rloo",
                     "macro_mc/fixed", "macro_gae/low_probability/equal"):
            estimate = np.concatenate([x[f"advantages/{name}"][b, :lengths[b]]
                                       for b in range(mask.shape[0])])
            assert row[f"credit/token/{name}/pearson"] == pytest.approx(
                np.corrcoef(estimate, truth)[0, 1], abs=1e-9), (step, name)
            assert row[f"credit/token/{name}/sign_agreement"] == pytest.approx(
                np.mean(np.sign(estimate) == np.sign(truth)), abs=1e-9), (step, name)
        # GRPO: one advantage per response, the group's normalised terminal rewards.
        grpo = x["advantages/grpo"][:, 0].reshape(-1, 2)
        assert np.allclose(grpo.sum(axis=1), 0, atol=1e-5)


def test_report_pools_seed_sets_and_states_differences_that_hold_on_every_set(probed, tmp_path):
    workdir, _ = probed
    page = tmp_path / "credit.md"
    page.write_text("# credit\n<!-- credit-study:start -->\n<!-- credit-study:end -->\nafter\n")
    results, plot = tmp_path / "results.json", tmp_path / "credit.png"
    # A run of two probes (steps 0 and 1: start and end, no middle) pooled with itself.
    assert credit_report.main([f"{workdir},{workdir}", str(workdir), "--page", str(page),
                               "--results", str(results), "--plot", str(plot)]) == 0
    out = json.loads(results.read_text())["results"]
    assert [(r["start"]["step"], r["end"]["step"], "middle" in r) for r in out] == [(0, 1, False)] * 2
    assert "| estimator | start | end |" in page.read_text()
    x = _load(workdir, 1)
    lengths = np.cumprod(x["response_mask"] != 0, axis=1).sum(axis=1)
    # A run pooled with itself: twice the states of the same prompts (one bootstrap unit each
    # across the copies), the same point estimates.
    pooled, single = out[0]["end"]["scores"]["token"], out[1]["end"]["scores"]["token"]
    assert pooled["token_gae"]["states"] == 2 * single["token_gae"]["states"] == 2 * lengths.sum()
    assert pooled["grpo"]["prompts"] == single["grpo"]["prompts"] == 3
    for name, entry in single.items():
        assert pooled[name]["pearson"]["value"] == pytest.approx(entry["pearson"]["value"])
    text = page.read_text()
    assert text.startswith("# credit\n") and text.endswith("after\n") and plot.stat().st_size
    for phase in ("start", "end"):
        for name in out[0][phase]["vs_token_gae"]:
            stated = f"- {name} at the {phase}:" in text
            holds = all(0 not in (credit_report.st.direction(r[phase]["vs_token_gae"][name]["ci"]),)
                        for r in out) and len({credit_report.st.direction(
                            r[phase]["vs_token_gae"][name]["ci"]) for r in out}) == 1
            assert stated == holds, (phase, name)


def _probe_draws(run_seed: int, step: int, *, states=40, continuations=8, positions=12,
                 mc_rows=24) -> set:
    """The keys every draw of a probe is made with (raw key data), as the probe derives them
    from `credit.seed` 1234, the run's seed and the step: the responses' positions
    (`fold_in(key, t)`), the segmentation key, the Monte Carlo macro values' rows and the
    truth's continuations (`continuation_keys`) at every position."""
    keys = credit.probe_keys(credit.probe_seed(1234, run_seed), step)
    rows = jnp.concatenate([keys.responses[None], keys.segments[None],
                            jax.random.split(keys.macro_mc, mc_rows),
                            credit_truth.continuation_keys(keys.truth, states,
                                                           continuations).reshape(-1)])
    drawn = jax.vmap(lambda k: jax.vmap(lambda t: jax.random.fold_in(k, t))(
        jnp.arange(positions)))(rows)
    return {tuple(k) for k in np.asarray(jax.random.key_data(drawn)).reshape(-1, 2).tolist()}


def test_runs_of_different_seeds_share_no_probe_draw(probed):
    workdir, _ = probed
    # The run's seed (0) reached its probe, which saved the seed of its draws.
    for step in (0, 1):
        assert int(_load(workdir, step)["probe_seed"]) == credit.probe_seed(1234, 0)
    seed_0, seed_1 = _probe_draws(0, 1), _probe_draws(1, 1)
    assert len(seed_0) == len(seed_1) == (2 + 24 + 40 * 8) * 12
    assert seed_0 == _probe_draws(0, 1), "the same run and step draws the same"
    assert not seed_0 & seed_1 and not seed_0 & _probe_draws(0, 0)
    # A multi-turn probe's episodes: other environment seeds in every run.
    episodes = [set(episode_seeds(credit.probe_seed(1234, s), 1, range(64), held_out=True))
                for s in (0, 1)]
    assert len(episodes[0]) == 64 and not episodes[0] & episodes[1]


def test_a_prompt_that_runs_share_is_one_bootstrap_unit(probed):
    workdir, _ = probed
    path = str(workdir / "credit" / "step_1.npz")
    single = dict(np.load(path))
    own = np.arange(single["response_ids"].shape[0]) // int(single["group_size"])

    def interval(inputs, prompts):
        scores, _ = probe_scores.score_probe(inputs, prompts, resamples=300)
        return scores["token"]["token_gae"]["pearson"]["ci"]

    # Copies of one run: its prompts are one unit each across the copies, so the clustered
    # interval is the single run's (each resample holds each drawn prompt's states twice: the
    # same weighted correlation); numbering each copy's prompts apart (the prompt-level
    # bootstrap) narrows it.
    copies, clusters = credit_report.pooled([path, path])
    assert clusters.tolist() == own.tolist() * 2
    naive = np.concatenate([own, own + own.max() + 1])
    clustered, prompt_level, alone = (interval(copies, clusters), interval(copies, naive),
                                      interval(single, own))
    assert clustered == pytest.approx(alone, abs=1e-12)
    assert clustered[1] - clustered[0] > prompt_level[1] - prompt_level[0]
    # Runs that share no prompt (the copy's prompts moved to other tokens): the clusters are
    # the prompt-level numbering itself, so both draw the same resamples of the same units and
    # the intervals are equal to the bit.
    other = workdir.parent / "other_prompts"
    (other / "credit").mkdir(parents=True, exist_ok=True)
    np.savez(other / "credit" / "step_1.npz", **dict(single, prompt_ids=single["prompt_ids"] + 1))
    disjoint, clusters = credit_report.pooled([path, str(other / "credit" / "step_1.npz")])
    assert clusters.tolist() == naive.tolist()
    assert interval(disjoint, clusters) == interval(disjoint, naive)


def test_report_refuses_to_pool_probes_of_different_truths_or_turns(probed, tmp_path):
    workdir, _ = probed
    x = _load(workdir, 0)
    assert str(x["truth"]) == "reward"
    fakes = {"older": {k: v for k, v in x.items() if k != "truth"},  # before credit.truth
             "gold": dict(x, truth=np.str_("gold")),
             "turns": dict(x, action_columns=np.zeros_like(x["response_mask"]))}
    for name, arrays in fakes.items():
        (tmp_path / name / "credit").mkdir(parents=True)
        np.savez(tmp_path / name / "credit" / "step_0.npz", **arrays)
    run = f"{workdir}/credit/step_0.npz"
    # A probe without `truth` was valued by the run's reward: pooled with today's.
    inputs, _ = credit_report.pooled([run, f"{tmp_path}/older/credit/step_0.npz"])
    assert inputs["response_ids"].shape[0] == 2 * x["response_ids"].shape[0]
    for name, kind in (("gold", "gold truth, single-turn"), ("turns", "reward truth, multi-turn")):
        line = ("error: probes of different kinds cannot be pooled or compared: reward truth, "
                f"single-turn: {workdir}, {tmp_path}/older; {kind}: {tmp_path}/{name}")
        with pytest.raises(SystemExit) as error:
            credit_report.pooled([run, f"{tmp_path}/older/credit/step_0.npz",
                                  f"{tmp_path}/{name}/credit/step_0.npz"])
        assert str(error.value) == line
        # Seed sets of one page too, refused before any probe is scored.
        with pytest.raises(SystemExit) as error:
            credit_report.main([f"{workdir},{tmp_path}/older", f"{tmp_path}/{name}",
                                "--page", str(tmp_path / "page.md")])
        assert str(error.value) == line


@pytest.mark.parametrize("field, value, words", [
    ("credit.continuations", 1, "compares two halves"),
    ("credit.rules", ("fixed", "parsing"), "rules cut on the device"),
    ("ppo.estimator", "grpo", "scores the run's critic"),
    # The arms x seeds runner vmaps its runs' steps and runs no probe.
    ("stage", "experiment", "inside a PPO run"),
])
def test_bad_probe_settings_are_one_line(field, value, words):
    cfg = tiny_config(**{**CREDIT, field: value})
    with pytest.raises(ValueError, match=words) as error:
        validate_config(cfg)
    assert "\n" not in str(error.value)


def test_fresh_values_agree_with_the_probes_and_give_its_advantages(restored):
    policy, inputs = restored
    report = credit_revalue.revalue(policy, inputs, **SIZES)
    tokens, states = report["tokens"], report["states"]
    pairs = list(zip(tokens["rows"], tokens["positions"]))
    assert len(set(pairs)) == SIZES["states"]
    # Both states of every drawn token, each once, with the probe's saved values beside them.
    expected = sorted({(b, t) for b, t in pairs} | {(b, t + 1) for b, t in pairs})
    assert list(zip(states["rows"], states["positions"])) == expected
    saved = _states(inputs)
    np.testing.assert_array_equal(states["saved_mean"],
                                  [inputs["state_mean"][saved[p]] for p in expected])
    # The restored policy is the probe's: its own rewards and critic values, reproduced.
    assert report["reproduced"]["ok"] and report["reproduced"]["max_reward_diff"] < 1e-4
    at = {p: i for i, p in enumerate(expected)}
    gamma, new_v, saved_v = inputs["gamma"], np.array(states["new_mean"]), inputs["state_mean"]
    for i, (b, t) in enumerate(pairs):
        assert tokens["new_reward"][i] == pytest.approx(inputs["rewards"][b, t], abs=1e-4)
        assert tokens["saved_advantage"][i] == pytest.approx(
            inputs["rewards"][b, t] + gamma * saved_v[saved[(b, t + 1)]] - saved_v[saved[(b, t)]])
        assert tokens["new_advantage"][i] == pytest.approx(
            tokens["new_reward"][i] + gamma * new_v[at[(b, t + 1)]] - new_v[at[(b, t)]])
    # The probe's own continuation returns against fresh ones: one distribution.
    assert report["saved_continuations"] == CREDIT["credit.continuations"]
    z = np.array([x for x in states["z"] if x is not None])
    assert report["consistent"] and states["p_value"] > 0.01 and np.all(np.abs(z) < 4)
    assert np.all(np.abs([x for x in tokens["z"] if x is not None]) < 4)
    assert credit_revalue.summary(report).endswith(": consistent")
    assert credit_revalue.exit_status(report) == 0


def test_a_shifted_truth_is_inconsistent_and_exits_1(restored):
    policy, inputs = restored
    # Every non-terminal state's saved value moved by four of its standard errors (its
    # continuation returns with it).
    shift = 4 * inputs["state_se"]
    corrupted = dict(inputs, state_mean=inputs["state_mean"] + shift,
                     state_returns=inputs["state_returns"] + shift[:, None])
    report = credit_revalue.revalue(policy, corrupted, **SIZES)
    assert not report["consistent"] and report["states"]["p_value"] < 1e-3
    assert report["reproduced"]["ok"]
    assert credit_revalue.summary(report).endswith(
        ": inconsistent: the saved values disagree with fresh ones (p < 0.001)")
    # The status the command returns for this comparison.
    assert credit_revalue.exit_status(report) == 1
    # A probe saved without its continuation returns has nothing for the split test.
    with pytest.raises(ValueError, match="saved no continuation returns"):
        credit_revalue.revalue(policy, {k: v for k, v in inputs.items() if k != "state_returns"},
                               **SIZES)


def test_the_command_exits_2_without_the_step(probed):
    workdir, _ = probed
    command = [sys.executable, str(ROOT / "experiments" / "credit_revalue.py"), str(workdir),
               *tiny_flags(**RUN), "--step=5", "--states=10", "--continuations=32"]
    result = subprocess.run(command, check=False, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        (f"error: {workdir}: no probe was saved at step 5 (credit/step_5.npz; probes at [0, 1]); "
         "steps with a probe and its policy: [0, 1]")]


def _phase(points: dict, differences: dict) -> dict:
    """One phase of a seed set's result at the token level: Pearson points and the paired
    differences (a, b) -> ci."""
    return {"start": {"scores": {"token": {n: {"pearson": {"value": v}} for n, v in points.items()}},
                      "pairs": {"token": {credit_report.pair_key(a, b): {"value": None, "ci": ci}
                                          for (a, b), ci in differences.items()}}}}


def test_a_rule_is_best_only_where_it_beats_each_other_rule_on_every_set():
    rules = ["macro_gae/x/equal", "macro_gae/y/equal", "macro_gae/z/equal"]
    x, y, z = rules
    points = {x: 0.30, y: 0.20, z: 0.10}
    beats = {(x, y): [0.01, 0.2], (x, z): [0.05, 0.3], (y, z): [-0.1, 0.2]}
    one = [_phase(points, beats), _phase(points, beats)]
    rank = credit_report.ranking(one, "start", "token", rules)
    assert rank == {"best": x, "leaders": [x, x], "not_distinguishable": [[], []]}
    assert credit_report.ranking_line(rank).startswith(f"best: {x} ")
    # On the second set x's lead over y covers 0 (the pair stored in the other order, negated).
    weaker = dict(beats)
    weaker.pop((x, y))
    weaker[(y, x)] = [-0.05, 0.02]
    rank = credit_report.ranking([one[0], _phase(points, weaker)], "start", "token", rules)
    assert rank == {"best": None, "leaders": [x, x], "not_distinguishable": [[], [y]]}
    assert credit_report.ranking_line(rank) == (
        f"highest point estimate: {x} (set 1; not distinguishable from none); "
        f"{x} (set 2; not distinguishable from {y})")
    # Another leader on one set is no best either.
    rank = credit_report.ranking([one[0], _phase({x: 0.1, y: 0.3, z: 0.0}, {
        (y, x): [0.1, 0.3], (y, z): [0.1, 0.4]})], "start", "token", rules)
    assert rank["best"] is None and rank["leaders"] == [x, y]


def test_a_constant_estimator_is_undefined_in_the_table():
    assert credit_report._cell({"value": 0.123, "ci": [0.01, 0.2]}) == "+0.12 [+0.01, +0.20]"
    assert credit_report._cell({"value": float("nan"), "ci": None}) == "undefined"
    assert np.isnan(credit_report._interval({"value": 0.0, "ci": None})).all()
    # Three probes or more: the first, middle and last; two: the first and last.
    assert credit_report.probe_phases(5) == [("start", 0), ("middle", 2), ("end", 4)]
    assert credit_report.probe_phases(2) == [("start", 0), ("end", 1)]
