"""The synthetic task's gold reward against hand-computed NDCG values, and its data: demonstrations
and generated preference candidates as the task defines them."""
import math

import numpy as np
import pytest

from marl_jax.data import synthetic as syn

TASK = syn.SyntheticTask(num_entities=6, num_words=6, doc_size=4, summary_items=2,
                         min_description=1, max_description=2, world_seed=3)


def _tokens(*texts, width=16):
    rows = [[TASK.ids[w] for w in t.split()] for t in texts]
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    return ids, mask


def _item(entity, words=None):
    desc = TASK.descriptions[entity, :TASK.description_lengths[entity]]
    words = [f"w{w:02d}" for w in desc] if words is None else words
    return " ".join([f"e{entity:02d}", *words, syn.SEP])


def _gold(document, *texts):
    ids, mask = _tokens(*texts)
    return syn.gold_score_tokens(TASK, np.repeat(document[None], len(texts), 0), ids, mask)


def test_gold_is_ndcg_by_hand():
    document = np.array([0, 1, 2, 3])
    order = document[np.argsort(TASK.importance_rank[document])]  # most important first
    best, second, third, last = order
    # In-document relevance (1 - rank / 3)^2: 1, 4/9, 1/9, 0; discounts 1, 1/log2(3).
    d1 = 1 / math.log2(3)
    idcg = 1 + (4 / 9) * d1
    eos = " " + syn.EOS
    ideal = _item(best) + " " + _item(second) + eos
    swapped = _item(second) + " " + _item(best) + eos
    skip = _item(best) + " " + _item(third) + eos
    no_eos = _item(best) + " " + _item(second)
    extra = _item(best) + " " + _item(second) + " " + _item(third) + eos
    duplicate = _item(best) + " " + _item(best) + eos
    outside = np.setdiff1d(np.arange(TASK.num_entities), document)[0]
    foreign = _item(best) + " " + _item(outside) + eos
    got = _gold(document, ideal, swapped, skip, no_eos, extra, duplicate, foreign)
    want = [1.0, (4 / 9 + 1 * d1) / idcg, (1 + (1 / 9) * d1) / idcg, 1.0 - 0.2, 1.0 - 0.1,
            1 / idcg, 1 / idcg]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert last not in (best, second)


def test_gold_scales_an_item_by_its_description_accuracy():
    document = np.array([0, 1, 2, 3])
    best, second = document[np.argsort(TASK.importance_rank[document])][:2]
    length = int(TASK.description_lengths[second])
    correct = [f"w{w:02d}" for w in TASK.descriptions[second, :length]]
    wrong_word = f"w{(int(TASK.descriptions[second, 0]) + 1) % TASK.num_words:02d}"
    garbled = [wrong_word] + correct[1:]
    padded = correct + [correct[-1]]  # one word too many
    d1 = 1 / math.log2(3)
    idcg = 1 + (4 / 9) * d1
    got = _gold(document, *(_item(best) + " " + _item(second, w) + " " + syn.EOS
                            for w in (garbled, padded)))
    want = [(1 + (4 / 9) * d1 * (length - 1) / length) / idcg,
            (1 + (4 / 9) * d1 * length / (length + 1)) / idcg]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_demonstrations_end_with_eos_and_truncated_candidates_do_not():
    task = syn.SyntheticTask(truncate_fraction=0.5, corrupt_fraction=0.0)
    pairs = syn.preference_pairs(task, 0, 400)
    texts = [p[k] for p in pairs for k in ("chosen", "rejected")]
    ended = np.array([t.endswith(syn.EOS) for t in texts])
    assert 0.4 < 1 - ended.mean() < 0.6
    demos = syn.sft_examples(task, 0, 50)
    assert all(d["response"].endswith(syn.EOS) for d in demos)
    with pytest.raises(ValueError, match="truncate_fraction"):
        syn.SyntheticTask(truncate_fraction=0.7, corrupt_fraction=0.5)
