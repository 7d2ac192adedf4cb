"""Parsing-based termination: macro actions from the syntax of the generated text (host side).

The paper cuts each response along a constituency parse: a tree node covering fewer than C tokens
(C = 5) becomes one macro, and single-token nodes join the previous macro. spaCy has no
constituency parser, so the hierarchy is derived from its dependency parse, where a token's
subtree is a phrase:

1. The response text is split into sentences (spaCy's parser); every sentence starts a macro.
2. Within a sentence, starting from the root, a node whose subtree spans fewer than `cutoff`
   tokens (span width = rightmost - leftmost descendant + 1, its token count in a projective
   parse) becomes one unit. A larger node is split into its left children's subtrees (each
   handled recursively), the head token alone, and its right children's subtrees, in text order.
3. Units are visited in text order; a unit of a single token joins the macro before it in the
   same sentence (the first unit of a sentence always starts a macro). Every other unit starts a
   new macro at its first token.

   "I went to the store yesterday and bought some fresh apples for my mother." (C = 5) gives
   units [I] [went] [to the store] [yesterday] [and] [bought] [some fresh apples]
   [for my mother] [.], hence the macros "I went | to the store yesterday and bought |
   some fresh apples | for my mother."

Macro starts are character offsets of the text; they are mapped onto the policy's own tokens.
The text is built from the generated token ids by incremental decoding (each token's piece is
the text its id adds to the decoded prefix, with a small re-decoded window so that byte-level
and sentencepiece decoders see their context, and tokens that end inside a multi-byte character
wait for the token that completes it), so every token owns an exact character range of exactly
the text that was parsed, whatever tokenization the policy sampled. A macro starting at
character c starts at the first token whose range ends after c. The joined pieces must equal the
tokenizer's decoding of the whole row; otherwise the row is a tokenizer mismatch.

A row that cannot be parsed (an id outside the tokenizer's vocabulary, a decoding mismatch, an
empty or whitespace-only text, a spaCy error) falls back to fixed n-grams of `fallback_n` tokens
and is counted in the stats. The result has the shared segment-id format of
`marl_jax.macro.termination`: int32 `[B, T]`, contiguous, starting at 0, 0 on padding, never an
empty macro, and with `isolate_last` the last valid token is its own macro.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading

import numpy as np

from marl_jax.macro import termination
from marl_jax.macro.checks import check_mask, check_rank, check_same_shape

logger = logging.getLogger(__name__)

FALLBACK_REASONS = ("empty", "mismatch", "error")
# Components of the standard English pipelines that the dependency parse does not need.
_UNUSED_COMPONENTS = ("tagger", "attribute_ruler", "lemmatizer", "ner", "senter")
_REPLACEMENT_CHAR = "\ufffd"

_pipelines = {}
_pipelines_lock = threading.Lock()


def load_pipeline(model="en_core_web_sm"):
    """The spaCy pipeline `model` (tokenizer, tok2vec and parser only), loaded once per process.

    Returns a `(nlp, lock)` pair; spaCy pipelines are not documented as thread-safe, so callers
    hold `lock` while running `nlp`.
    """
    with _pipelines_lock:
        if model not in _pipelines:
            try:
                import spacy
            except ImportError as error:
                raise ImportError("parsing termination needs spaCy: pip install spacy") from error
            try:
                nlp = spacy.load(model, exclude=list(_UNUSED_COMPONENTS))
            except OSError as error:
                raise OSError(
                    f"spaCy pipeline {model!r} is not installed; install it with: "
                    f"python -m spacy download {model}") from error
            if "parser" not in nlp.pipe_names:
                raise ValueError(f"spaCy pipeline {model!r} has no dependency parser")
            _pipelines[model] = (nlp, threading.Lock())
        return _pipelines[model]


def sentence_macro_starts(doc, cutoff):
    """Indices (into `doc`) of the spaCy tokens that start a macro, ascending (the rule above)."""
    starts = []
    for sentence in doc.sents:
        units = []
        stack = [sentence.root]
        while stack:
            node = stack.pop()
            if isinstance(node, tuple):
                units.append(node)
                continue
            width = node.right_edge.i - node.left_edge.i + 1
            if width < cutoff:
                units.append((node.left_edge.i, width))
                continue
            # Popped in text order: left subtrees, the head alone, right subtrees.
            stack.extend(reversed(list(node.rights)))
            stack.append((node.i, 1))
            stack.extend(reversed(list(node.lefts)))
        units.sort()
        sentence_starts = [sentence.start]
        for first, width in units:
            if width > 1 and first > sentence_starts[-1]:
                sentence_starts.append(first)
        starts.extend(sentence_starts)
    return starts


def macro_char_starts(doc, cutoff):
    """Character offsets in `doc.text` where macros start."""
    return np.asarray([doc[i].idx for i in sentence_macro_starts(doc, cutoff)], np.int64)


class TokenizerMismatch(ValueError):
    """The incrementally decoded pieces do not reproduce the decoded row."""


class IncrementalDecoder:
    """Text and per-token character ends of generated token ids (see the module docstring)."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not (hasattr(backend, "decode") and hasattr(backend, "get_vocab_size")):
            raise ValueError(
                "tokenizer must be a fast (Rust `tokenizers`-backed) tokenizer, got "
                f"{type(tokenizer).__name__}")
        self._backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def _decode(self, ids):
        return self._backend.decode(ids, skip_special_tokens=True)

    def text_and_ends(self, ids):
        """`(text, ends)`: `text` decoded from `ids` (a list), `ends[t]` = end offset of token t.

        A token that adds no complete character (a special token, the first bytes of a
        multi-byte character) shares the end of the next token that does.
        """
        if any(i < 0 or i >= self.vocab_size for i in ids):
            raise TokenizerMismatch("token id outside the tokenizer's vocabulary")
        ends = np.zeros(len(ids), np.int64)
        pieces, length = [], 0
        pending = prefix_offset = read_offset = 0
        prefix_text = ""
        for t in range(len(ids)):
            new_text = self._decode(ids[prefix_offset:t + 1])
            complete = len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR)
            # The last token flushes whatever is still waiting (special tokens, a cut character).
            if not complete and t < len(ids) - 1:
                continue
            piece = new_text[len(prefix_text):]
            pieces.append(piece)
            length += len(piece)
            ends[pending:t + 1] = length
            pending = t + 1
            prefix_offset, read_offset = read_offset, t + 1
            prefix_text = self._decode(ids[prefix_offset:read_offset])
        text = "".join(pieces)
        if text != self._decode(ids):
            raise TokenizerMismatch("incremental decoding does not reproduce the decoded row")
        return text, ends


class ParsingTermination:
    """Segment ids `[B, T]` of generated responses from a syntactic parse of their text.

    Args:
      tokenizer: the policy's fast tokenizer (`transformers` or `tokenizers.Tokenizer`).
      model: spaCy pipeline name (e.g. "en_core_web_sm").
      cutoff: C, a subtree spanning fewer tokens is one macro (>= 2).
      fallback_n: n of the fixed n-gram fallback for rows that cannot be parsed.
      isolate_last: make the last valid token its own macro.
      num_threads: host worker threads for `submit` (spaCy itself runs one batch at a time per
        process; more threads overlap decoding and mapping of queued batches).
    """

    def __init__(self, tokenizer, *, model="en_core_web_sm", cutoff=5, fallback_n=5,
                 isolate_last=True, num_threads=1):
        for name, value, low in (("cutoff", cutoff, 2), ("fallback_n", fallback_n, 1),
                                 ("num_threads", num_threads, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self._decoder = IncrementalDecoder(tokenizer)
        self._nlp, self._nlp_lock = load_pipeline(model)
        self.cutoff, self.fallback_n, self.isolate_last = cutoff, fallback_n, isolate_last
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_threads, thread_name_prefix="parsing-termination")
        self._warned = False

    def __call__(self, response_ids, response_mask):
        """Segment ids for one batch.

        Args:
          response_ids: int `[B, T]` generated token ids (numpy or jax).
          response_mask: `[B, T]` left-aligned 0/1 mask of the valid response tokens.

        Returns:
          `(segment_ids, stats)`: int32 numpy `[B, T]`, and float metrics
          "macro/parse_fallback_frac" (fraction of non-empty rows that fell back),
          "macro/parse_fallback_{empty,mismatch,error}" (row counts) and
          "macro/parse_macro_len_mean" (mean tokens per macro over the batch).
        """
        response_ids, response_mask = _check_inputs(response_ids, response_mask)
        lengths = response_mask.sum(axis=1)
        fallback = {}
        rows, texts, token_ends = self._decode_rows(response_ids, lengths, fallback)
        starts = np.zeros(response_mask.shape, bool)
        for b, ends, result in zip(rows, token_ends, self._parse(texts)):
            if isinstance(result, Exception):
                fallback[b] = ("error", f"{type(result).__name__}: {result}")
                continue
            starts[b, np.searchsorted(ends, result, side="right")] = True
        if self.isolate_last:
            valid_rows = np.nonzero(lengths)[0]
            starts[valid_rows, lengths[valid_rows] - 1] = True
        segment_ids = termination.segment_ids_from_starts(starts, response_mask)
        if fallback:
            fallback_rows = np.asarray(sorted(fallback))
            ngram_ids = np.asarray(termination.fixed_ngram(
                response_mask, self.fallback_n, isolate_last=self.isolate_last))
            segment_ids[fallback_rows] = ngram_ids[fallback_rows]
            self._report(fallback)
        return segment_ids, self._stats(segment_ids, lengths, fallback)

    def submit(self, response_ids, response_mask):
        """`__call__` on a host thread; returns a `concurrent.futures.Future` of its result.

        Numpy inputs are copied first, so the caller may reuse its buffers at once.
        """
        response_ids, response_mask = (
            np.array(x) if isinstance(x, np.ndarray) else x for x in (response_ids, response_mask))
        return self._executor.submit(self, response_ids, response_mask)

    def close(self):
        """Waits for submitted batches and stops the worker threads."""
        self._executor.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _decode_rows(self, response_ids, lengths, fallback):
        """Rows to parse, their texts and per-token character ends; failures go to `fallback`."""
        rows, texts, token_ends = [], [], []
        for b in np.nonzero(lengths)[0]:
            try:
                text, ends = self._decoder.text_and_ends(response_ids[b, :lengths[b]].tolist())
            except TokenizerMismatch as error:
                fallback[b] = ("mismatch", str(error))
                continue
            except Exception as error:  # a decoder failure costs this row only
                fallback[b] = ("error", f"{type(error).__name__}: {error}")
                continue
            if not text.strip():
                fallback[b] = ("empty", "no text to parse")
                continue
            rows.append(b)
            texts.append(text)
            token_ends.append(ends)
        return rows, texts, token_ends

    def _parse(self, texts):
        """Macro character starts of each text, or the exception that text raised."""
        if not texts:
            return []
        with self._nlp_lock:
            try:
                docs = list(self._nlp.pipe(texts))
            except Exception:  # one bad text must not cost the whole batch its parse
                docs = []
                for text in texts:
                    try:
                        docs.append(self._nlp(text))
                    except Exception as error:  # spaCy raises plain exceptions (e.g. E088)
                        docs.append(error)
        results = []
        for doc in docs:
            if isinstance(doc, Exception):
                results.append(doc)
                continue
            try:
                results.append(macro_char_starts(doc, self.cutoff))
            except Exception as error:
                results.append(error)
        return results

    def _stats(self, segment_ids, lengths, fallback):
        counts = collections.Counter(reason for reason, _ in fallback.values())
        non_empty = int(np.count_nonzero(lengths))
        num_macros = int(np.sum(np.where(lengths > 0, segment_ids.max(axis=1) + 1, 0)))
        stats = {"macro/parse_fallback_frac": len(fallback) / non_empty if non_empty else 0.0,
                 "macro/parse_macro_len_mean": (float(lengths.sum()) / num_macros
                                                if num_macros else 0.0)}
        for reason in FALLBACK_REASONS:
            stats[f"macro/parse_fallback_{reason}"] = float(counts[reason])
        return stats

    def _report(self, fallback):
        for b, (reason, detail) in sorted(fallback.items()):
            logger.debug("parsing termination: row %d falls back to fixed %d-grams (%s: %s)",
                         b, self.fallback_n, reason, detail)
        if not self._warned:
            self._warned = True
            reasons = collections.Counter(reason for reason, _ in fallback.values())
            logger.warning(
                "parsing termination fell back to fixed %d-grams for %d rows of a batch (%s); "
                "the fraction is logged as macro/parse_fallback_frac, details at DEBUG level",
                self.fallback_n, len(fallback), dict(reasons))


def _check_inputs(response_ids, response_mask):
    response_ids, response_mask = np.asarray(response_ids), np.asarray(response_mask)
    check_rank(response_ids, 2, "response_ids")
    check_same_shape(response_ids, "response_ids", response_mask=response_mask)
    if not np.issubdtype(response_ids.dtype, np.integer):
        raise ValueError(f"response_ids must be integer token ids, got dtype {response_ids.dtype}")
    check_mask(response_mask, "response_mask", left_aligned=True)
    return response_ids, response_mask.astype(np.int32)
