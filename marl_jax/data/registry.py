"""The real datasets: hub location, splits, and the row converters of each."""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional

from marl_jax.data import apps, hh_rlhf, tldr, webgpt


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """How to read one dataset.

    Attributes:
      name: the short name used by the loaders ("tldr", ...).
      hub_name: Hugging Face Hub repository.
      hub_config: hub config name (None for the default).
      hub_splits: canonical split ("train", "validation", "test") -> hub split name.
      hub_data_files: for repositories that ship a loading script: a `hf://` json file pattern
        with a `{split}` field, read with the json builder instead.
      preference_pair, prompt, sft_example: row -> record converters (None: not defined).
      options: keyword options the converters accept (passed through from the loaders).
    """

    name: str
    hub_name: str
    hub_config: Optional[str]
    hub_splits: Mapping[str, str]
    preference_pair: Optional[Callable]
    prompt: Optional[Callable]
    sft_example: Optional[Callable]
    hub_data_files: Optional[str] = None
    options: tuple = ()


DATASETS = {
    "tldr": DatasetSpec(
        name="tldr", hub_name="openai/summarize_from_feedback", hub_config="comparisons",
        hub_splits={"train": "train", "validation": "validation"},
        preference_pair=tldr.preference_pair, prompt=tldr.prompt_record,
        sft_example=tldr.sft_example, options=("include_cnndm",)),
    "tldr_sft": DatasetSpec(
        name="tldr_sft", hub_name="CarperAI/openai_summarize_tldr", hub_config=None,
        hub_splits={"train": "train", "validation": "valid", "test": "test"},
        preference_pair=None, prompt=tldr.sft_set_prompt, sft_example=tldr.sft_set_example),
    "hh_rlhf": DatasetSpec(
        name="hh_rlhf", hub_name="Dahoas/full-hh-rlhf", hub_config=None,
        hub_splits={"train": "train", "test": "test"},
        preference_pair=hh_rlhf.preference_pair, prompt=hh_rlhf.prompt_record,
        sft_example=hh_rlhf.sft_example),
    "webgpt": DatasetSpec(
        name="webgpt", hub_name="openai/webgpt_comparisons", hub_config=None,
        hub_splits={"train": "train"},
        preference_pair=webgpt.preference_pair, prompt=webgpt.prompt_record,
        sft_example=webgpt.sft_example),
    "apps": DatasetSpec(
        name="apps", hub_name="codeparrot/apps", hub_config=None,
        hub_splits={"train": "train", "test": "test"},
        hub_data_files="hf://datasets/codeparrot/apps/{split}.jsonl",
        preference_pair=None, prompt=apps.prompt_record, sft_example=apps.sft_example,
        options=("difficulties",)),
}


def get_spec(name):
    """The `DatasetSpec` called `name`; ValueError listing the known names otherwise."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {sorted(DATASETS)}")
    return DATASETS[name]
