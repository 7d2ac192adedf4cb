"""A summarisation-like task with a known gold reward: the offline test bed of marl_jax.

A prompt is a "document": `doc: e07 e19 ... summary:` listing `doc_size` distinct entities. A
response is a summary of `summary_items` items, each an entity followed by that entity's fixed
description (a word sequence of entity-dependent length) and `;`, then the end-of-sequence
token:

    e19 w03 w11 ... w28 ; e07 w15 ... ; ... <eos>

The gold function values summaries that pick the document's most important entities (by a hidden
importance ranking fixed for the task) and list them from most to least important, with correct
descriptions: NDCG@`summary_items` with each item's gain scaled by its description accuracy. Key
decisions (which entity opens the next item) sit at every item start, so they are spread from the
first token to the last and, because description lengths vary, fall at varied offsets inside
fixed n-gram macros. With 8 items of 10-14 tokens, responses are about 96 tokens long.

SFT demonstrations are imperfect (random substitutions and swaps of the ideal ordering);
preference pairs are labelled by the gold reward with Bradley-Terry annotator noise.

Everything is a pure function of `SyntheticTask` (the "world": importance ranking and
descriptions, fixed by `world_seed`) and explicit numpy generators, so data is reproducible.
The tokenizer is a real word-level `tokenizers` tokenizer saved to disk and loaded through
`transformers.AutoTokenizer`, the same path as any pretrained model's tokenizer.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
DOC, SUMMARY, SEP = "doc:", "summary:", ";"


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """The world of the synthetic task. All sizes are in tokens or entities."""

    num_entities: int = 32
    num_words: int = 32
    doc_size: int = 12
    summary_items: int = 8
    min_description: int = 8
    max_description: int = 12
    world_seed: int = 1234
    # Imperfect demonstrations: each ideal item is replaced by a random unused document entity
    # with probability `demo_substitute`, then each adjacent pair is swapped with `demo_swap`.
    demo_substitute: float = 0.25
    demo_swap: float = 0.25
    # Annotators prefer the better summary with probability sigmoid(gold gap / temperature).
    annotator_temperature: float = 0.05
    # Generated preference candidates: the share cut off without EOS (prefixes), and the share
    # with garbled descriptions or duplicated items; the rest are noisy summaries.
    truncate_fraction: float = 0.25 / 3
    corrupt_fraction: float = 0.5 / 3
    missing_eos_penalty: float = 0.2
    extra_item_penalty: float = 0.1

    def __post_init__(self):
        if self.doc_size > self.num_entities:
            raise ValueError(
                f"doc_size={self.doc_size} must not exceed num_entities={self.num_entities}")
        if not 1 <= self.summary_items <= self.doc_size:
            raise ValueError(
                f"summary_items={self.summary_items} must be in [1, doc_size={self.doc_size}]")
        if not (0 <= self.truncate_fraction and 0 <= self.corrupt_fraction
                and self.truncate_fraction + self.corrupt_fraction <= 1):
            raise ValueError(f"truncate_fraction={self.truncate_fraction} and corrupt_fraction="
                             f"{self.corrupt_fraction} must be >= 0 and sum to at most 1")
        if not 1 <= self.min_description <= self.max_description:
            raise ValueError("need 1 <= min_description <= max_description, got "
                             f"{self.min_description}, {self.max_description}")

    # ---- vocabulary -------------------------------------------------------------------------
    @functools.cached_property
    def vocab(self) -> list[str]:
        specials = [PAD, BOS, EOS, UNK, DOC, SUMMARY, SEP]
        entities = [f"e{i:02d}" for i in range(self.num_entities)]
        words = [f"w{i:02d}" for i in range(self.num_words)]
        return specials + entities + words

    @functools.cached_property
    def ids(self) -> dict[str, int]:
        return {tok: i for i, tok in enumerate(self.vocab)}

    @property
    def entity_offset(self) -> int:
        return self.ids["e00"]

    @property
    def word_offset(self) -> int:
        return self.ids["w00"]

    @property
    def prompt_length(self) -> int:
        """Tokens of every prompt: `<bos> doc: e.. (doc_size) summary:`."""
        return self.doc_size + 3

    @property
    def max_response_length(self) -> int:
        """Tokens of the longest ideal response, EOS included."""
        return self.summary_items * (self.max_description + 2) + 1

    # ---- the hidden world ------------------------------------------------------------------
    @functools.cached_property
    def _world(self):
        rng = np.random.default_rng(self.world_seed)
        importance_rank = rng.permutation(self.num_entities)  # 0 = most important
        lengths = rng.integers(self.min_description, self.max_description + 1,
                               size=self.num_entities)
        descriptions = np.full((self.num_entities, self.max_description), -1, np.int32)
        for e in range(self.num_entities):
            descriptions[e, :lengths[e]] = rng.integers(0, self.num_words, size=lengths[e])
        return importance_rank.astype(np.int32), lengths.astype(np.int32), descriptions

    @property
    def importance_rank(self) -> np.ndarray:
        """[num_entities] int32: global importance rank of each entity, 0 = most important."""
        return self._world[0]

    @property
    def description_lengths(self) -> np.ndarray:
        """[num_entities] int32."""
        return self._world[1]

    @property
    def descriptions(self) -> np.ndarray:
        """[num_entities, max_description] word indices, -1 past each description's length."""
        return self._world[2]


# ---- documents and summaries as entity lists ---------------------------------------------------
def sample_documents(task: SyntheticTask, rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, doc_size] int32 entity indices, distinct within a row."""
    keys = rng.random((n, task.num_entities))
    return np.argsort(keys, axis=1)[:, :task.doc_size].astype(np.int32)


def ideal_summary(task: SyntheticTask, documents: np.ndarray) -> np.ndarray:
    """[n, summary_items]: each document's most important entities, most important first."""
    ranks = task.importance_rank[documents]
    order = np.argsort(ranks, axis=1, kind="stable")[:, :task.summary_items]
    return np.take_along_axis(documents, order, axis=1)


def noisy_summary(task: SyntheticTask, rng: np.random.Generator, documents: np.ndarray,
                  substitute: float, swap: float) -> np.ndarray:
    """[n, summary_items]: the ideal summary with random substitutions and adjacent swaps."""
    summaries = ideal_summary(task, documents).copy()
    for row, doc in zip(summaries, documents):
        unused = [e for e in doc if e not in row]
        rng.shuffle(unused)
        for j in range(len(row)):
            if unused and rng.random() < substitute:
                row[j] = unused.pop()
        for j in range(len(row) - 1):
            if rng.random() < swap:
                row[j], row[j + 1] = row[j + 1], row[j]
    return summaries


# ---- text ----------------------------------------------------------------------------------------
def prompt_text(task: SyntheticTask, document: np.ndarray) -> str:
    entities = " ".join(f"e{e:02d}" for e in document)
    return f"{BOS} {DOC} {entities} {SUMMARY}"


def summary_text(task: SyntheticTask, entities: np.ndarray, *, eos: bool = True) -> str:
    items = []
    for e in entities:
        words = task.descriptions[e, :task.description_lengths[e]]
        items.append(" ".join([f"e{e:02d}"] + [f"w{w:02d}" for w in words] + [SEP]))
    return " ".join(items + ([EOS] if eos else []))


def build_tokenizer(task: SyntheticTask, directory: str):
    """Writes a word-level tokenizer for `task` to `directory`; returns it loaded by transformers.

    Every process writes its own temporary copy and loads that; the first complete copy is
    renamed into place, so concurrent processes never read a half-written file.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from marl_jax.models.tokenizer import write_tokenizer

    raw = Tokenizer(models.WordLevel(vocab=task.ids, unk_token=UNK))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, unk_token=UNK, padding_side="left")
    return write_tokenizer(fast, directory)


# ---- the gold reward ---------------------------------------------------------------------------
def gold_score_tokens(task: SyntheticTask, documents, response_ids, response_mask):
    """Gold reward of token-level responses.

    Args:
      documents: [B, doc_size] entity indices of each prompt.
      response_ids: [B, T] token ids of the responses (left-aligned).
      response_mask: [B, T] 1 on response tokens (the EOS token included).
    Returns:
      [B] float32 in [-1, 1]: NDCG@summary_items where an item's gain is its entity's in-document
      relevance ((1 - rank / (doc_size - 1))^2: 1 for the most important document entity, 0 for
      the least) times its description accuracy, minus penalties for items beyond
      `summary_items` and for a missing EOS. Items whose opening token is not an unused document
      entity gain nothing. Jittable; numpy in, numpy out when called on host arrays.
    """
    return np.asarray(_gold_jit(task, jnp.asarray(documents), jnp.asarray(response_ids),
                                jnp.asarray(response_mask)))


@functools.partial(jax.jit, static_argnums=0)
def _gold_jit(task, documents, response_ids, response_mask):
    return gold_score_jax(task, documents, response_ids, response_mask)


def gold_score_jax(task: SyntheticTask, documents, response_ids, response_mask):
    """The traced body of `gold_score_tokens` (use inside a jitted evaluation)."""
    ids = task.ids
    b, t = response_ids.shape
    mask = response_mask.astype(bool)
    tokens = jnp.where(mask, response_ids, ids[PAD])
    is_sep = (tokens == ids[SEP]) & mask
    is_eos = (tokens == ids[EOS]) & mask
    # Content stops at the first EOS.
    after_eos = jnp.cumsum(is_eos, axis=1) - is_eos > 0
    content = mask & ~after_eos & ~is_eos
    item = jnp.cumsum(is_sep, axis=1) - is_sep  # item index of each token (SEP belongs to its item)
    num_items = t  # upper bound; items beyond summary_items are penalised below
    starts = content & jnp.concatenate(
        [jnp.ones((b, 1), bool), is_sep[:, :-1]], axis=1)
    pos = jnp.arange(t)[None, :]
    start_pos = jnp.where(starts, pos, -1)
    item_start = jax.lax.cummax(start_pos, axis=1)
    offset = pos - item_start  # 0 on the entity token
    entity_tok = jnp.take_along_axis(tokens, jnp.maximum(item_start, 0), axis=1)
    entity = entity_tok - task.entity_offset
    is_entity = (entity >= 0) & (entity < task.num_entities)
    entity = jnp.clip(entity, 0, task.num_entities - 1)

    desc_len = jnp.asarray(task.description_lengths)[entity]  # [B, T]
    desc = jnp.asarray(task.descriptions)[entity]  # [B, T, max_description]
    k = jnp.clip(offset - 1, 0, task.max_description - 1)
    expected = jnp.take_along_axis(desc, k[..., None], axis=2)[..., 0] + task.word_offset
    word_slot = content & ~is_sep & (offset >= 1)
    correct = word_slot & (offset <= desc_len) & (tokens == expected)

    seg = jnp.where(content | is_sep, item, num_items)  # out-of-content tokens -> dump segment
    def per_item(x):
        return jax.vmap(lambda xi, si: jax.ops.segment_sum(xi, si, num_items + 1))(x, seg)
    n_correct = per_item(correct.astype(jnp.float32))[:, :num_items]
    n_words = per_item(word_slot.astype(jnp.float32))[:, :num_items]
    closed = per_item(is_sep.astype(jnp.float32))[:, :num_items] > 0
    first_tok_entity = per_item((starts & is_entity).astype(jnp.float32))[:, :num_items] > 0
    item_entity = per_item(jnp.where(starts, entity, 0))[:, :num_items]
    item_desc_len = jnp.asarray(task.description_lengths)[item_entity].astype(jnp.float32)
    accuracy = n_correct / jnp.maximum(item_desc_len, n_words)

    # Relevance of each entity inside its document: 1 for the most important, 0 for the least.
    doc_ranks = jnp.asarray(task.importance_rank)[documents]  # [B, doc_size]
    in_doc_rank = jnp.argsort(jnp.argsort(doc_ranks, axis=1), axis=1)  # 0 = most important
    relevance_doc = _relevance(task, in_doc_rank)
    match = item_entity[:, :, None] == documents[:, None, :]  # [B, items, doc_size]
    in_doc = match.any(axis=2) & first_tok_entity & closed
    relevance = jnp.where(in_doc, (match * relevance_doc[:, None, :]).sum(axis=2), 0.0)
    # Only an entity's first occurrence counts.
    j = jnp.arange(num_items)
    earlier_same = (item_entity[:, :, None] == item_entity[:, None, :]) & in_doc[:, None, :] & (
        j[None, None, :] < j[None, :, None])
    first_occurrence = ~earlier_same.any(axis=2)
    gain = relevance * accuracy * first_occurrence

    s = task.summary_items
    discount = 1.0 / jnp.log2(jnp.arange(s) + 2.0)
    dcg = (gain[:, :s] * discount).sum(axis=1)
    ideal_rel = _relevance(task, jnp.arange(s))
    idcg = (ideal_rel * discount).sum()
    total_items = closed.sum(axis=1)
    extra = jnp.maximum(total_items - s, 0)
    has_eos = is_eos.any(axis=1)
    score = dcg / idcg - task.extra_item_penalty * extra - task.missing_eos_penalty * (~has_eos)
    return jnp.clip(score, -1.0, 1.0).astype(jnp.float32)


def _relevance(task, in_doc_rank):
    # Squared so that picking the top entities, and their order, matters more than filling slots.
    return (1.0 - in_doc_rank / max(task.doc_size - 1, 1)) ** 2


# ---- datasets for the three stages -------------------------------------------------------------
def sft_examples(task: SyntheticTask, seed: int, n: int) -> list[dict]:
    """Imperfect demonstrations: [{"prompt", "response", "document"}] with EOS in the response."""
    rng = np.random.default_rng(seed)
    docs = sample_documents(task, rng, n)
    summaries = noisy_summary(task, rng, docs, task.demo_substitute, task.demo_swap)
    return [dict(prompt=prompt_text(task, d), response=summary_text(task, s), document=d)
            for d, s in zip(docs, summaries)]


def preference_pairs(task: SyntheticTask, seed: int, n: int) -> list[dict]:
    """[{"prompt", "chosen", "rejected", "document"}] labelled by gold with annotator noise.

    Candidates are noisy summaries at random noise levels; `truncate_fraction` of them are cut
    off without EOS and `corrupt_fraction` carry garbled descriptions or duplicated items, so the
    reward model sees the failure modes a policy produces during RL.
    """
    rng = np.random.default_rng(seed)
    docs = sample_documents(task, rng, n)
    texts, token_rows = [[], []], [[], []]
    for side in range(2):
        for d in docs:
            level = rng.uniform(0.0, 0.8)
            entities = noisy_summary(task, rng, d[None], level, level)[0]
            u = rng.random()
            if u < task.truncate_fraction:
                text = _truncated(task, rng, entities)
            elif u < task.truncate_fraction + task.corrupt_fraction:
                text = _corrupt(task, rng, entities)
            else:
                text = summary_text(task, entities)
            texts[side].append(text)
            token_rows[side].append([task.ids[w] for w in text.split()])
    gold = [_gold_of_rows(task, docs, rows) for rows in token_rows]
    first_wins = annotator_prefers_first(task, rng, gold[0], gold[1])
    pairs = []
    for i, d in enumerate(docs):
        a, b = texts[0][i], texts[1][i]
        chosen, rejected = (a, b) if first_wins[i] else (b, a)
        pairs.append(dict(prompt=prompt_text(task, d), chosen=chosen, rejected=rejected,
                          document=d))
    return pairs


def annotator_prefers_first(task: SyntheticTask, rng: np.random.Generator, gold_first,
                            gold_second) -> np.ndarray:
    """[n] bool: the Bradley-Terry annotator's choice between two responses of known gold,
    P(first) = sigmoid((gold_first - gold_second) / annotator_temperature)."""
    gap = np.asarray(gold_first, np.float64) - np.asarray(gold_second, np.float64)
    p_first = 1.0 / (1.0 + np.exp(-gap / task.annotator_temperature))
    return rng.random(len(gap)) < p_first


def label_sampled_pairs(task: SyntheticTask, seed: int, documents, ids_a, mask_a, ids_b,
                        mask_b) -> np.ndarray:
    """[n] bool, True where the annotator prefers response a: the labels of preference pairs
    whose responses (token ids and masks [n, R]) a policy sampled for `documents` [n, doc]."""
    gold_a = gold_score_tokens(task, documents, ids_a, mask_a)
    gold_b = gold_score_tokens(task, documents, ids_b, mask_b)
    return annotator_prefers_first(task, np.random.default_rng(seed), gold_a, gold_b)


def rl_prompts(task: SyntheticTask, seed: int, n: int) -> list[dict]:
    """[{"prompt", "document"}] for PPO rollouts or held-out evaluation."""
    rng = np.random.default_rng(seed)
    docs = sample_documents(task, rng, n)
    return [dict(prompt=prompt_text(task, d), document=d) for d in docs]


def _corrupt(task, rng, entities) -> str:
    words = summary_text(task, entities, eos=False).split()
    if rng.random() < 0.5:  # garbled descriptions
        for i, w in enumerate(words):
            if w.startswith("w") and rng.random() < 0.3:
                words[i] = f"w{rng.integers(task.num_words):02d}"
        return " ".join(words + [EOS])
    repeated = np.concatenate([entities[:2], entities[:-2]])  # duplicated items
    return summary_text(task, repeated)


def _truncated(task, rng, entities) -> str:
    """A summary cut off before its end, without EOS: what a policy emits when it runs out of
    tokens, and a prefix scored on what it already holds."""
    words = summary_text(task, entities, eos=False).split()
    return " ".join(words[:rng.integers(1, len(words))])


def _gold_of_rows(task, docs, rows):
    # A fixed width (rounded up) keeps the jitted gold function from recompiling per call.
    width = -(-max(task.max_response_length, *(len(r) for r in rows)) // 64) * 64
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
        mask[i, :len(r)] = 1
    return gold_score_tokens(task, docs, ids, mask)
