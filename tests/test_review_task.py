"""The review task: prompts built offline from the shipped word lists, and its gold on
hand-written responses (every term computed by hand)."""
import numpy as np
import pytest

from marl_jax.data import reviews
from marl_jax.eval import review_gold
from marl_jax.eval.review_gold import ReviewGold

HOTEL = reviews.ReviewSpec("hotel", "the Riverside Inn", ("room", "breakfast"), "again")


def test_prompts_are_distinct_deterministic_and_the_parts_disjoint():
    specs = reviews.all_specs()
    assert len(specs) == 10 * 8 * 28 * 5 == len({s.prompt for s in specs})
    sizes = {"eval": 128, "sft": 512, "rm": 512, "rl": 1024}
    parts = reviews.review_prompts(7, sizes)
    assert parts == reviews.review_prompts(7, sizes)
    assert parts != reviews.review_prompts(8, sizes)
    texts = {name: [r["prompt"] for r in rows] for name, rows in parts.items()}
    assert {k: len(v) for k, v in texts.items()} == sizes
    for name, part in texts.items():
        assert len(set(part)) == len(part)
        for other, rest in texts.items():
            if other != name:
                assert not set(part) & set(rest), (name, other)
    # The held-out part does not move when the later parts change size.
    assert reviews.review_prompts(7, {"eval": 128, "rl": 5000})["eval"] == parts["eval"]
    record = parts["rl"][0]
    assert reviews.spec_from_record(record).record() == record
    assert record["closing"] in reviews.CLOSINGS and len(record["aspects"]) == 2
    assert record["prompt"].endswith(f'The last word must be "{record["closing"]}".')


def test_prompt_text_and_bad_sizes():
    assert HOTEL.prompt == ('In two short sentences, review the Riverside Inn (a hotel). Mention '
                            'the room and the breakfast. The last word must be "again".')
    with pytest.raises(ValueError, match="need 12000 prompts but the word lists make 11200"):
        reviews.review_prompts(0, {"eval": 1000, "rl": 11000})
    with pytest.raises(ValueError, match="part 'rl' must be an integer >= 0"):
        reviews.review_prompts(0, {"rl": -1})
    with pytest.raises(KeyError, match="lacks \\['closing'\\]"):
        reviews.spec_from_record({"prompt": "x", "category": "hotel", "item": "y",
                                  "aspects": ["room"]})


def test_each_term_by_hand():
    gold = ReviewGold(min_words=8, max_words=40)
    texts = [
        # 14 words, both aspects ("rooms" by its lemma), ends with the closing word.
        "The rooms were spotless and the breakfast was wonderful. I would stay there again!",
        # 5 words, no aspect ("roomy" is not "room"), the closing word last.
        "A roomy place but again",
        # 10 words: "a b c" three times and "a": trigrams abc bca cab abc bca cab abc bca:
        # 8, of which 5 repeat an earlier one.
        "Good nice fine good nice fine good nice fine good",
        "",
    ]
    t = gold.terms([HOTEL] * len(texts), texts)
    np.testing.assert_allclose(t["aspects"], [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(t["ending"], [1.0, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(t["length"], [1.0, 5 / 8, 1.0, 0.0])
    np.testing.assert_allclose(t["fluency"], [1.0, 1.0, 1 - 5 / 8, 1.0])
    # tone: VADER's compound in [-1, 1] mapped to [0, 1]; 0.5 for a text without sentiment.
    assert t["tone"][0] > 0.8 and t["tone"][3] == 0.5
    negative = gold.terms([HOTEL], ["The staff were rude, the bed was filthy and the food was "
                                    "awful. A terrible stay."])
    assert negative["tone"][0] < 0.2
    want = t["fluency"] * (0.4 * t["tone"] + 0.3 * t["aspects"] + 0.15 * t["ending"]
                           + 0.15 * t["length"])
    np.testing.assert_allclose(gold.score([HOTEL] * len(texts), texts), want)
    assert gold.score([HOTEL], texts[:1])[0] == pytest.approx(0.4 * t["tone"][0] + 0.6)


def test_length_above_the_window_and_records_as_input():
    gold = ReviewGold(min_words=2, max_words=4)
    record = HOTEL.record()
    t = gold.terms([record, record], ["one two three four five six", "one two three"])
    # 6 words > 4: 1 - (6 - 4) / 4.
    np.testing.assert_allclose(t["length"], [0.5, 1.0])
    assert review_gold.ends_with("Come back again.\n", "again")
    assert not review_gold.ends_with("again, soon", "again")


def test_bad_input_is_named():
    gold = ReviewGold()
    with pytest.raises(ValueError, match="2 prompt records for 1 responses"):
        gold.score([HOTEL, HOTEL], ["fine"])
    with pytest.raises(TypeError, match="scores decoded text; got list"):
        gold.score([HOTEL], [[1, 2, 3]])
    with pytest.raises(ValueError, match="min_words <= max_words"):
        ReviewGold(min_words=10, max_words=5)
