"""Macro actions: termination conditions (segment ids) and macro-level GAE."""
from marl_jax.macro.advantage import REWARD_AGGREGATIONS, VALUE_WEIGHTINGS, gae, macro_gae, whiten
from marl_jax.macro.termination import (
    STRATEGIES,
    entropy_spans,
    fixed_ngram,
    perplexity,
    randomized_ngram,
    segment,
    segment_ids_from_starts,
)

__all__ = [
    "REWARD_AGGREGATIONS",
    "STRATEGIES",
    "VALUE_WEIGHTINGS",
    "entropy_spans",
    "fixed_ngram",
    "gae",
    "macro_gae",
    "perplexity",
    "randomized_ngram",
    "segment",
    "segment_ids_from_starts",
    "whiten",
]
