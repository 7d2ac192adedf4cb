"""The step termination (reasoning-step macros): a macro ends at the token that holds a
delimiter's first character in the decoded response. Its segments equal a reference loop
written here (decode the response, find every delimiter in the text, cut after the token that
completes the text up to the delimiter's first character) on hand-made texts with newlines,
sentence ends, none at all and within turns, and on random token sequences, with two real
byte-level BPE tokenizers: one with GPT-2's (and SmolLM2's) pre-split, whose delimiters
straddle tokens ("." then " Then"), one whose merges cross them ("3.\nTh", "i! ")."""
import numpy as np
import pytest

from marl_jax.macro import steps, termination
from marl_jax.models.tokenizer import write_tokenizer

DELIMITERS = steps.DEFAULT_DELIMITERS
CORPUS = [
    "First we add 2 and 3.\nThen we get 5. So the answer is 5!",
    "Is it 3.14? Yes. It is pi, e.g. the ratio.\n\n- step one\n- step two",
    "Wait... what? Let me check: 12 + 7 = 19.\nSo 19 it is! Done.",
    "Café, naïve — déjà vu? Oui! Très bien.\nFin.",
]
TEXTS = [
    "First we add 2 and 3.\nThen we get 5. So the answer is 5!",
    "No delimiter here at all",
    "Is it 3.14? Yes. It is e.g. pi.\n\n- step one\n- step two",
    "Ends with a newline\n",
    "\nStarts with one. And two.  Three!",
    "Café — naïve? Oui! Très bien.\nFin",
]


@pytest.fixture(scope="module", params=["pre-split", "merged"])
def tokenizer(request, tmp_path_factory):
    """A byte-level BPE tokenizer trained on `CORPUS`, with GPT-2's pre-split (words,
    punctuation and whitespace apart: a sentence end's "." and " " in two tokens) or without it
    (merges across spaces, punctuation and newlines); written and loaded by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                 use_regex=request.param == "pre-split")
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(CORPUS * 8, trainers.BpeTrainer(
        vocab_size=330, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", pad_token="<eos>")
    return write_tokenizer(fast, str(tmp_path_factory.mktemp("bpe") / "tokenizer"))


@pytest.fixture(scope="module")
def table(tokenizer):
    return steps.step_table(tokenizer, DELIMITERS)


def occurrences(tokenizer, ids, delimiters):
    """Every occurrence of every delimiter in the decoded `ids`, as the (first, last) tokens
    holding its first and last characters: the first token after which the decoded prefix
    holds that character."""
    decode = lambda x: tokenizer.backend_tokenizer.decode(x, skip_special_tokens=True)  # noqa: E731
    text = decode(ids)
    prefixes = [decode(ids[:t + 1]) for t in range(len(ids))]

    def holder(i):
        return next(t for t, p in enumerate(prefixes) if p[:i + 1] == text[:i + 1])

    return [(holder(i), holder(i + len(d) - 1)) for d in delimiters
            for i in range(len(text)) if text.startswith(d, i)]


def reference_segments(tokenizer, ids, delimiters, isolate_last=True):
    """One response's segment ids by the definition: a macro ends at the token holding an
    occurrence's first character."""
    ends = {first for first, _ in occurrences(tokenizer, ids, delimiters)}
    out, macro = [], 0
    for t in range(len(ids)):
        if t and (t - 1 in ends or (isolate_last and t == len(ids) - 1)):
            macro += 1
        out.append(macro)
    return out


def _batch(rows, width):
    """Left-aligned `[B, T]` ids and mask of `rows` (lists of ids), padded with id 0."""
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for b, row in enumerate(rows):
        ids[b, :len(row)], mask[b, :len(row)] = row, 1
    return ids, mask


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_hand_made_vocabulary_by_hand():
    """Token texts chosen by hand: a delimiter split over two tokens ("." then " Then"),
    inside one token (". So"), after a newline token, at the end of the text (no space: no
    sentence end), across a special token that adds no text, and a two-newline delimiter over
    two tokens, whose first token ends the macro."""
    texts = ["", "We", " add", " 2", ".", " Then", " 3", ".5", "!", "\n", "x", ". So", "?"]
    table = steps.table_of_texts(texts, DELIMITERS)
    # We add 2 . | Then 3 .5 ! \n | x . So | x | ?    ("We add 2. Then 3.5!\nx. Sox?")
    ids = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 10, 12]]
    got = termination.reasoning_steps(np.array(ids), np.ones((1, 13), np.int32), table)
    np.testing.assert_array_equal(got, [[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 3, 4]])
    # a . <special> b \n \n c. " "   with ". " and "\n\n":  a . | <s> b \n | \n c. | " "
    texts = ["", "a", ".", " b", "\n", "c.", " "]
    table = steps.table_of_texts(texts, (". ", "\n\n"))
    got = termination.reasoning_steps(np.array([[1, 2, 0, 3, 4, 4, 5, 6]]),
                                      np.ones((1, 8), np.int32), table)
    np.testing.assert_array_equal(got, [[0, 0, 1, 1, 1, 2, 2, 3]])


def test_hand_made_texts_equal_the_reference(tokenizer, table):
    rows = [_encode(tokenizer, text) for text in TEXTS]
    # Pre-split, sentence ends straddle two tokens; merged, tokens hold a delimiter and more.
    found = [o for row in rows for o in occurrences(tokenizer, row, DELIMITERS)]
    pieces = [tokenizer.backend_tokenizer.decode([i]) for row in rows for i in row]
    assert sum(first < last for first, last in found) >= 5 or sum(
        len(p.strip()) > 1 and any(d in p for d in DELIMITERS) for p in pieces) >= 5
    ids, mask = _batch(rows, max(map(len, rows)) + 3)
    for isolate_last in (True, False):
        got = np.asarray(termination.segment("step", mask, token_ids=ids, step_table=table,
                                             isolate_last=isolate_last))
        for b, row in enumerate(rows):
            assert got[b, :len(row)].tolist() == reference_segments(
                tokenizer, row, DELIMITERS, isolate_last), (TEXTS[b], isolate_last)
            assert not got[b, len(row):].any()
    # No delimiter at all: one macro, and the last token alone.
    none = _encode(tokenizer, TEXTS[1])
    assert got[1, :len(none)].tolist() == [0] * len(none)
    assert np.asarray(termination.segment("step", mask, token_ids=ids, step_table=table))[
        1, :len(none)].tolist() == [0] * (len(none) - 1) + [1]


def test_random_token_sequences_equal_the_reference(tokenizer):
    """Any ids of the vocabulary (special tokens and bytes of split characters included), under
    delimiters of one to three characters."""
    delimiters = ("\n", ". ", "? ", "! ", "...", " - ")
    table = steps.step_table(tokenizer, delimiters)
    rng = np.random.default_rng(0)
    texts = steps.token_texts(tokenizer)
    # Half the ids from the tokens that begin or end with a delimiter's character.
    edges = [i for i, text in enumerate(texts) if text and {text[0], text[-1]} & set("\n.?!- ")]
    rows = [np.where(rng.random(n) < 0.5, rng.choice(edges, n), rng.integers(0, len(texts), n))
            .tolist() for n in rng.integers(1, 40, 24)]
    ids, mask = _batch(rows, 40)
    got = np.asarray(termination.segment("step", mask, token_ids=ids, step_table=table))
    for b, row in enumerate(rows):
        assert got[b, :len(row)].tolist() == reference_segments(tokenizer, row, delimiters), b
    # Many occurrences, some of them over two tokens or more.
    found = [o for row in rows for o in occurrences(tokenizer, row, delimiters)]
    assert len(found) >= 20 and sum(first < last for first, last in found) >= 5


def test_within_turns_each_turn_is_read_alone(tokenizer):
    """A trajectory's turns (observation spans between them, holding delimiters of their own)
    are cut as their texts decoded one by one, a turn boundary always ending a macro; a
    delimiter that the joined turns would form across a boundary ("wait.." then ". ok" makes
    "...") cuts nothing."""
    delimiters = ("\n", ". ", "...")
    table = steps.step_table(tokenizer, delimiters)
    dot = tokenizer.convert_tokens_to_ids(".")
    turns = [[_encode(tokenizer, "First we add 2.\nThen 3"), _encode(tokenizer, "wait") + [dot, dot],
              [dot] + _encode(tokenizer, " ok. Done")],
             [_encode(tokenizer, "No delimiter"), _encode(tokenizer, "Is it 3.14? Yes.\n\nSo")]]
    observation = _encode(tokenizer, "Result. 5\n")
    width = 64
    ids = np.zeros((len(turns), width), np.int32)
    mask, turn_ids = np.zeros_like(ids), np.zeros_like(ids)
    for b, row in enumerate(turns):
        t = 0
        for k, turn in enumerate(row):
            ids[b, t:t + len(turn)], mask[b, t:t + len(turn)], turn_ids[b, t:] = turn, 1, k
            t += len(turn)
            ids[b, t:t + len(observation)] = observation
            t += len(observation)
    for isolate_last in (True, False):
        got = np.asarray(termination.segment("step", mask, turn_ids=turn_ids, token_ids=ids,
                                             step_table=table, isolate_last=isolate_last))
        for b, row in enumerate(turns):
            want, first = [], 0
            for turn in row:
                want += [first + s for s in reference_segments(tokenizer, turn, delimiters,
                                                               isolate_last)]
                first = want[-1] + 1
            assert got[b][mask[b] != 0].tolist() == want, (b, isolate_last)
    # Read as one text, the second row's turns would cut "wait" at its first dot.
    joined = [i for turn in turns[0] for i in turn]
    assert reference_segments(tokenizer, joined, delimiters, False) != [
        s for s in got[0][mask[0] != 0]]


def test_bad_delimiters_are_named():
    for bad, match in (((), "non-empty tuple"), ("\n", "non-empty tuple"), (("",), "''"),
                       (("。",), "not ASCII")):
        with pytest.raises(ValueError, match=match):
            steps.table_of_texts(["a"], bad)
    with pytest.raises(ValueError, match="token_ids and a step_table"):
        termination.segment("step", np.ones((1, 3), np.int32))
