"""Where raw rows come from: the Hugging Face Hub, or local json / jsonl / parquet files.

Both paths go through `datasets.load_dataset`, so local files in a dataset's public schema are
read exactly as the hub copy would be (same Arrow types, nested structs, nulls).

Split names: "train", "validation" (aliases "valid", "val", "dev") and "test". In a local
directory a file belongs to a split when its name, up to the first ".", "-" or "_", is one of the
split's aliases: `train.jsonl`, `valid.json`, `validation-00000-of-00001.parquet`. Files are
searched recursively; when the directory has a sub-directory named after the dataset's hub config
(e.g. `comparisons/`, the hub layout), only that sub-directory is searched. A path to a single
file is read as the requested split whatever the file is called. Malformed lines of local JSON
Lines files are left out and reported (see json_lines.py).
"""
from __future__ import annotations

import os
import pathlib
import re

from marl_jax.data import json_lines

SPLIT_ALIASES = {
    "train": ("train",),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test",),
}
_BUILDER_BY_SUFFIX = {
    ".json": "json", ".jsonl": "json", ".json.gz": "json", ".jsonl.gz": "json",
    ".parquet": "parquet",
}


def canonical_split(split):
    """"train" | "validation" | "test" for any alias; ValueError otherwise."""
    for name, aliases in SPLIT_ALIASES.items():
        if split in aliases:
            return name
    known = sorted(alias for aliases in SPLIT_ALIASES.values() for alias in aliases)
    raise ValueError(f"split must be one of {known}, got {split!r}")


def load_rows(spec, path, split, *, cache_dir=None):
    """Raw rows of one split as a `datasets.Dataset`, where they came from, and the malformed
    lines left out of them (`json_lines.BadLines`, one per local JSON Lines file that has any).

    Args:
      spec: the dataset's `DatasetSpec` (hub name, config, hub split names).
      path: None for the hub, else a local file or directory.
      split: a split name or alias (see `SPLIT_ALIASES`).
      cache_dir: `datasets` cache directory (None: the default cache).
    """
    split = canonical_split(split)
    if path is None:
        return _load_hub(spec, split, cache_dir), spec.hub_name, []
    rows, bad_lines = _load_local(spec, pathlib.Path(path), split, cache_dir)
    return rows, str(path), bad_lines


def _load_hub(spec, split, cache_dir):
    if split not in spec.hub_splits:
        raise ValueError(
            f"{spec.hub_name} has no {split!r} split on the hub (it has "
            f"{sorted(spec.hub_splits)}); use paper_split() to split the training rows")
    import datasets  # deferred: heavy, and not needed by users of the synthetic task alone

    hub_split = spec.hub_splits[split]
    if spec.hub_data_files is not None:
        # The repository ships a loading script, which `datasets` no longer runs; its raw
        # json files are read directly instead.
        files = spec.hub_data_files.format(split=hub_split)
        return datasets.load_dataset("json", data_files={split: files}, split=split,
                                     cache_dir=cache_dir)
    return datasets.load_dataset(spec.hub_name, spec.hub_config, split=hub_split,
                                 cache_dir=cache_dir)


def _load_local(spec, path, split, cache_dir):
    if not path.exists():
        raise FileNotFoundError(f"{spec.name} data path does not exist: {path}")
    if path.is_file():
        files = [path]
    else:
        files = _split_files(spec, path, split)
    import datasets  # deferred: heavy, and not needed by users of the synthetic task alone

    builders = {_builder(file) for file in files}
    if len(builders) != 1:
        raise ValueError(f"{spec.name} {split} files under {path} mix json and parquet: "
                         f"{[str(f) for f in files]}")
    builder, bad_lines = builders.pop(), []
    if builder == "json":
        names = [file.name if path.is_file() else str(file.relative_to(path)) for file in files]
        files, bad_lines = json_lines.check_files(
            files, names, cache_dir or datasets.config.HF_DATASETS_CACHE)
    rows = datasets.load_dataset(builder, data_files={split: [str(f) for f in files]},
                                 split=split, cache_dir=cache_dir)
    return rows, bad_lines


def _split_files(spec, directory, split):
    if spec.hub_config and (directory / spec.hub_config).is_dir():
        directory = directory / spec.hub_config
    pattern = re.compile(r"^(%s)([-_.]|$)" % "|".join(SPLIT_ALIASES[split]))
    files = sorted(
        file for file in directory.rglob("*")
        if file.is_file() and _suffix(file) in _BUILDER_BY_SUFFIX and pattern.match(file.name))
    if not files:
        raise FileNotFoundError(
            f"no {split} files (json, jsonl or parquet named {SPLIT_ALIASES[split]}...) for "
            f"{spec.name} under {directory}")
    return files


def _suffix(file):
    name = file.name.lower()
    for suffix in sorted(_BUILDER_BY_SUFFIX, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    return os.path.splitext(name)[1]


def _builder(file):
    suffix = _suffix(file)
    if suffix not in _BUILDER_BY_SUFFIX:
        raise ValueError(f"unsupported data file {file}: expected one of "
                         f"{sorted(_BUILDER_BY_SUFFIX)}")
    return _BUILDER_BY_SUFFIX[suffix]
