"""Datasets: the real preference / prompt / SFT sets (tldr, tldr_sft, hh_rlhf, webgpt, apps),
the paper's SFT / RM / RL split, chat-template formatting and length filtering.

The synthetic task lives in `marl_jax.data.synthetic`.
"""
from marl_jax.data.chat import filter_by_length, format_prompt, format_records
from marl_jax.data.loaders import load_preference_pairs, load_prompts, load_sft_examples
from marl_jax.data.records import LoadedRecords
from marl_jax.data.registry import DATASETS, DatasetSpec
from marl_jax.data.splits import paper_split

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "LoadedRecords",
    "filter_by_length",
    "format_prompt",
    "format_records",
    "load_preference_pairs",
    "load_prompts",
    "load_sft_examples",
    "paper_split",
]
