"""The review reward-model study's comparison of scores with the gold (experiments/
review_rm_study.py), on hand-made numbers."""
import importlib.util
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("review_rm_study",
                                               ROOT / "experiments" / "review_rm_study.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def test_agreement_counts_pairs_of_distinct_gold_and_tokens_and_correlation_is_within_prompts():
    k = study.SAMPLES  # 4
    gold = np.array([[0.1, 0.5, 0.5, 0.9], [0.2, 0.4, 0.6, 0.8]])
    ids = np.arange(2 * k * 3).reshape(2, k, 3)
    ids[1, 3] = ids[1, 2]  # the same tokens twice: that pair is no preference
    mask = np.ones_like(ids)
    # Prompt 1 is scored 10 higher than prompt 0 throughout: only within-prompt order counts.
    scores = np.array([[0.0, 1.0, 3.0, 2.0], [10.0, 13.0, 12.0, 11.0]])
    dev = dict(ids=ids, mask=mask, gold=gold, terms={"tone": gold, "length": np.ones((2, k))})
    out = study.compare(scores, dev)
    # Prompt 0: 5 pairs of distinct gold (not (1, 2)); ordered as the gold: (0,1), (0,2),
    # (0,3), (1,3), not (2,3) -> 4. Prompt 1: 5 pairs (not (2, 3), the same tokens); ordered as
    # the gold: (0,1), (0,2), (0,3), not (1,2) or (1,3) -> 3.
    assert out["pairs"] == 10 and out["agreement"] == pytest.approx(7 / 10)
    centred = lambda x: (x - x.mean(axis=1, keepdims=True)).ravel()
    want = np.corrcoef(centred(scores), centred(gold))[0, 1]
    assert out["correlation"] == pytest.approx(want)
    assert out["term_correlation"]["tone"] == pytest.approx(want)
    assert out["term_correlation"]["length"] is None  # constant: no correlation


def test_every_setting_keeps_its_parts_before_the_dev_prompts():
    for name, overrides in study.SETTINGS.items():
        config = study.setting_config(overrides)
        assert study.parts_end(config) <= study.DEV_OFFSET, name
    shipped = study.setting_config({})
    assert shipped.rm.group_by_prompt and study.setting_config(
        study.SETTINGS["pairs_lr3e-5"]).rm.learning_rate == 3e-5
