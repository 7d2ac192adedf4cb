"""Record lists with load statistics, and the row-level error that sends a row to the skip count.

Every loader returns `LoadedRecords`: a plain `list` of dicts with a `load_stats` attribute

    {"dataset": "tldr", "split": "train", "source": "<hub name or path>",
     "rows": 92858, "kept": 92534,
     "skipped": {"empty summaries[1].text": 3, ...},    # malformed rows
     "dropped": {"tie (score_0 == score_1)": 321, ...}}  # well-formed rows left out by design

Malformed rows are reported once per load with a single `logging` warning; rows dropped by design
(ties, duplicates, filters) only with an info line.
"""
from __future__ import annotations

import collections
import logging

logger = logging.getLogger("marl_jax.data")


class BadRow(ValueError):
    """A row that cannot be used; the message is the reason it is counted under."""


class DroppedRow(Exception):
    """A well-formed row that is left out by design; the message is the reason."""


class LoadedRecords(list):
    """A list of record dicts carrying the `load_stats` of the load that produced it."""

    def __init__(self, records=(), load_stats=None):
        super().__init__(records)
        self.load_stats = load_stats or {}


class RowTally:
    """Counts kept, skipped (malformed) and dropped rows of one load, and reports them once."""

    def __init__(self, dataset, split, source):
        self.dataset, self.split, self.source = dataset, split, source
        self.rows = 0
        self.skipped = collections.Counter()
        self.dropped = collections.Counter()

    def skip(self, reason, count):
        """Counts `count` rows that never became rows (malformed lines of a file) as skipped."""
        self.rows += count
        self.skipped[reason] += count

    def convert(self, rows, convert_row):
        """Applies `convert_row` to each row; returns the records it produced (None = nothing)."""
        records = []
        for row in rows:
            self.rows += 1
            try:
                record = convert_row(row)
            except BadRow as error:
                self.skipped[str(error)] += 1
                continue
            except DroppedRow as reason:
                self.dropped[str(reason)] += 1
                continue
            records.append(record)
        return records

    def finish(self, records):
        """Wraps `records` with their stats and logs the skip summary once."""
        stats = {
            "dataset": self.dataset,
            "split": self.split,
            "source": self.source,
            "rows": self.rows,
            "kept": len(records),
            "skipped": dict(self.skipped),
            "dropped": dict(self.dropped),
        }
        where = f"{self.dataset}[{self.split}] from {self.source}"
        if self.skipped:
            logger.warning("%s: skipped %d of %d rows (%s)", where, sum(self.skipped.values()),
                           self.rows, _describe(self.skipped))
        if self.dropped:
            logger.info("%s: dropped %d of %d rows by design (%s)", where,
                        sum(self.dropped.values()), self.rows, _describe(self.dropped))
        return LoadedRecords(records, stats)


def _describe(counter):
    return ", ".join(f"{reason}: {count}" for reason, count in counter.most_common())


def field(row, dotted_name):
    """`row["a"]["b"]` for `dotted_name` "a.b"; a missing or null field is a `BadRow`."""
    value = row
    for part in dotted_name.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            raise BadRow(f"missing field {dotted_name}")
        value = value[part]
    return value


def text_field(row, dotted_name):
    """A non-empty string field (whitespace-only counts as empty)."""
    return check_text(field(row, dotted_name), dotted_name)


def check_text(value, name):
    """`value` if it is a non-empty string, else a `BadRow` naming `name`."""
    if value is None:
        raise BadRow(f"missing field {name}")
    if not isinstance(value, str):
        raise BadRow(f"non-string field {name}")
    if not value.strip():
        raise BadRow(f"empty {name}")
    return value
