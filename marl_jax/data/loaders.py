"""Public loaders: preference pairs, prompts and SFT examples of the real datasets.

Each returns `LoadedRecords`, a list of dicts with a `load_stats` attribute (see records.py):

- `load_preference_pairs` -> `{"prompt", "chosen", "rejected", ...}` (used by reward modelling),
- `load_prompts`          -> `{"prompt", ...}` (PPO rollouts and evaluation; duplicates removed,
                             first occurrence kept, so TL;DR yields one prompt per post),
- `load_sft_examples`     -> `{"prompt", "response", ...}` (supervised fine-tuning).

`path=None` reads the hub copy with `datasets.load_dataset(hub_name, ...)`; otherwise `path` is a
local file or directory of json / jsonl / parquet files in the same public schema (see
sources.py for how split files are found). Dataset-specific options: `include_cnndm` (tldr),
`difficulties` (apps, a subset of `apps.DIFFICULTIES`). Common options: `cache_dir` (the
`datasets` cache) and `max_rows` (read only the first rows of the split).
"""
from __future__ import annotations

import functools

from marl_jax.data import apps, json_lines
from marl_jax.data.records import DroppedRow, RowTally
from marl_jax.data.registry import get_spec
from marl_jax.data.sources import canonical_split, load_rows


def load_preference_pairs(name, path=None, split="train", **options):
    """Preference pairs `{"prompt", "chosen", "rejected"}` of dataset `name`."""
    return _load(name, "preference_pair", path, split, options)


def load_prompts(name, path=None, split="train", **options):
    """Distinct prompts `{"prompt", ...}` of dataset `name` (first occurrence kept)."""
    return _load(name, "prompt", path, split, options)


def load_sft_examples(name, path=None, split="train", **options):
    """Supervised examples `{"prompt", "response"}` of dataset `name`."""
    return _load(name, "sft_example", path, split, options)


def _load(name, kind, path, split, options):
    spec = get_spec(name)
    convert = getattr(spec, kind)
    if convert is None:
        available = [k for k in ("preference_pair", "prompt", "sft_example") if getattr(spec, k)]
        raise ValueError(f"dataset {name!r} defines no {kind} records; it has: {available}")
    cache_dir = options.pop("cache_dir", None)
    max_rows = options.pop("max_rows", None)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise TypeError(f"unknown options {unknown} for dataset {name!r}; it accepts "
                        f"{sorted(spec.options) + ['cache_dir', 'max_rows']}")
    _check_options(options)
    split = canonical_split(split)
    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 0):
        raise ValueError(f"max_rows must be a non-negative int, got {max_rows!r}")
    rows, source, bad_lines = load_rows(spec, path, split, cache_dir=cache_dir)
    if max_rows is not None:
        rows = rows.select(range(min(max_rows, len(rows))))
    tally = RowTally(name, split, source)
    for bad in bad_lines:
        lines = bad.reached(max_rows)
        if lines:
            tally.skip(json_lines.reason(bad.name, lines), len(lines))
    convert = functools.partial(convert, **options)
    if kind == "prompt":
        convert = _distinct_prompts(convert)
    return tally.finish(tally.convert(rows, convert))


def _distinct_prompts(convert):
    seen = set()

    def convert_distinct(row):
        record = convert(row)
        if record["prompt"] in seen:
            raise DroppedRow("duplicate prompt")
        seen.add(record["prompt"])
        return record

    return convert_distinct


def _check_options(options):
    difficulties = options.get("difficulties")
    if difficulties is not None:
        if isinstance(difficulties, str):
            options["difficulties"] = difficulties = (difficulties,)
        bad = sorted(set(difficulties) - set(apps.DIFFICULTIES))
        if bad:
            raise ValueError(f"difficulties must be drawn from {apps.DIFFICULTIES}, got {bad}")
