"""Training metrics: `<workdir>/metrics.jsonl`, TensorBoard scalars, Weights & Biases (when
`config.logging.wandb`, `marl_jax.train.wandb_log`), progress bar, summary table.

Each logged step is one JSON object on one line, with `stage` and `step` plus TRL-style names
(`objective/kl`, `loss/policy_avg`, ...); values are scalars, strings, None, or lists and dicts
of them (per-prompt results, an experiment's plan; arrays become nested lists). Rows are flushed
and fsynced as they are written, so a killed run keeps every row it logged. Non-finite floats are written as the strings "NaN",
"Infinity" and "-Infinity" (the file stays strict JSON); `read_metrics` turns them back into
floats. Only process 0 writes; on other processes every method is a no-op.

TensorBoard runs live in `<workdir>/tb/<stage>`, or `<workdir>/tb/<stage>/<key>=<value>,...` when a
row carries run keys (by default `arm` and `seed`), with the metric name as tag and `step` as
step.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np
import tqdm

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def metrics_path(workdir: str | os.PathLike) -> str:
    return os.path.join(os.fspath(workdir), METRICS_FILE)


def _encode_float(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _to_json_value(key: str, value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_to_json_value(key, item) for item in value]
    if isinstance(value, Mapping):
        return {str(k): _to_json_value(f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return _encode_float(float(value))
    raise ValueError(f"metric {key!r} has unsupported type {type(value).__name__}")


def _encode_row(row: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(row, Mapping):
        raise ValueError(f"row must be a dict, got {type(row).__name__}")
    for key in ("stage", "step"):
        if key not in row:
            raise ValueError(f"row is missing {key!r}: {sorted(row)}")
    host_row = jax.device_get(dict(row))
    encoded = {str(key): _to_json_value(str(key), value) for key, value in host_row.items()}
    if not isinstance(encoded["stage"], str) or not encoded["stage"]:
        raise ValueError(f"row['stage']={row['stage']!r} must be a non-empty string")
    if isinstance(encoded["step"], bool) or not isinstance(encoded["step"], int):
        raise ValueError(f"row['step']={row['step']!r} must be an int")
    return encoded


def _decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_value(item) for item in value]
    if isinstance(value, dict):
        return {k: _decode_value(v) for k, v in value.items()}
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    return value


def _decode_row(row: dict[str, Any]) -> dict[str, Any]:
    return {key: value if key == "stage" else _decode_value(value) for key, value in row.items()}


def _complete_lines(path: str) -> list[str]:
    """Lines of the file, without a trailing partial line left by a killed writer."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    return [line for line in lines[:-1] if line.strip()]


def read_metrics(workdir: str | os.PathLike, *, stage: str | None = None) -> list[dict[str, Any]]:
    """Rows of `<workdir>/metrics.jsonl` in file order (optionally only `stage`'s).

    Non-finite floats come back as floats; a partial last line left by a killed writer is skipped.
    """
    path = metrics_path(workdir)
    if not os.path.exists(path):
        return []
    rows = []
    for number, line in enumerate(_complete_lines(path), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} is not a JSON object: {err}") from None
        if stage is None or row.get("stage") == stage:
            rows.append(_decode_row(row))
    return rows


def _tb_run_name(stage: str, values: Mapping[str, Any], run_keys: Sequence[str]) -> str:
    parts = [f"{key}={values[key]}" for key in run_keys if values.get(key) is not None]
    return os.path.join(stage, ",".join(parts)) if parts else stage


class MetricsWriter:
    """Appends metric rows to `<workdir>/metrics.jsonl`, TensorBoard and W&B, on process 0 only.

    Args:
      workdir: run directory (created if missing).
      process_index: this process's index; default `jax.process_index()`.
      tensorboard: also write TensorBoard event files.
      run_keys: row keys that select a TensorBoard run inside the stage directory.
      logging: the `config.logging` section; with `wandb` True every row also goes to a W&B
        run whose config is `run_config` (the run's whole config, as a dict).
    """

    def __init__(self, workdir: str | os.PathLike, *, process_index: int | None = None,
                 tensorboard: bool = True, run_keys: Sequence[str] = ("arm", "seed"),
                 logging: Mapping[str, Any] | None = None,
                 run_config: Mapping[str, Any] | None = None):
        self.workdir = os.fspath(workdir)
        self.process_index = jax.process_index() if process_index is None else process_index
        self.active = self.process_index == 0
        self.path = metrics_path(self.workdir)
        self._tensorboard = tensorboard
        self._run_keys = tuple(run_keys)
        self._file: TextIO | None = None
        self._tb_writers: dict[str, Any] = {}
        self._purge_steps: dict[str, int] = {}
        self._wandb = None
        if self.active:
            os.makedirs(self.workdir, exist_ok=True)
            if logging is not None and logging["wandb"]:
                from marl_jax.train.wandb_log import WandbRun

                self._wandb = WandbRun(logging, run_config or {}, self.workdir)

    def _open(self) -> TextIO:
        if self._file is None:
            if os.path.exists(self.path):
                with open(self.path, "rb+") as f:
                    data = f.read()
                    if data and not data.endswith(b"\n"):
                        f.truncate(data.rfind(b"\n") + 1)
            self._file = open(self.path, "a", encoding="utf-8")
        return self._file

    def write(self, row: Mapping[str, Any]) -> None:
        """Appends one row: `stage` (str), `step` (int), and metric values (TensorBoard gets the
        numeric scalars)."""
        if not self.active:
            return
        encoded = _encode_row(row)
        f = self._open()
        f.write(json.dumps(encoded, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
        if self._tensorboard:
            self._write_tensorboard(encoded)
        if self._wandb is not None:
            self._wandb.log(encoded)

    def _write_tensorboard(self, row: dict[str, Any]) -> None:
        run = _tb_run_name(row["stage"], row, self._run_keys)
        writer = self._tb_writers.get(run)
        if writer is None:
            import tensorboardX

            # Event file names carry only the second and host; a unique suffix keeps a writer
            # reopened within the same second (a quick resume) from overwriting the last file.
            writer = tensorboardX.SummaryWriter(
                os.path.join(self.workdir, TB_DIR, run),
                purge_step=self._purge_steps.pop(run, None),
                filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:8]}")
            self._tb_writers[run] = writer
        skip = {"stage", "step", *self._run_keys}
        for key, value in row.items():
            if key in skip or isinstance(value, (bool, list, dict)) or value is None:
                continue
            if isinstance(value, str):
                if value not in _NON_FINITE:
                    continue
                value = _NON_FINITE[value]
            writer.add_scalar(key, value, global_step=row["step"])
        writer.flush()

    def truncate_after(self, stage: str, step: int, **match: Any) -> int:
        """Drops rows of `stage` (and matching `match`, e.g. arm=..., seed=...) with step > `step`.

        Called after restoring the checkpoint of `step`, so steps logged after it and run again
        are not duplicated. The file is rewritten atomically (temporary file + os.replace), and
        the matching TensorBoard run hides its older events past `step`. Returns the number of
        rows dropped.
        """
        if not self.active:
            return 0
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard and set(match) <= set(self._run_keys):
            run = _tb_run_name(stage, match, self._run_keys)
            writer = self._tb_writers.pop(run, None)
            if writer is not None:
                writer.close()
            self._purge_steps[run] = step + 1
        if not os.path.exists(self.path):
            return 0
        kept, dropped = [], 0
        for line in _complete_lines(self.path):
            row = json.loads(line)
            if (row.get("stage") == stage and all(row.get(k) == v for k, v in match.items())
                    and row.get("step", -1) > step):
                dropped += 1
            else:
                kept.append(line)
        fd, tmp_path = tempfile.mkstemp(prefix=f".{METRICS_FILE}.", dir=self.workdir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_path, self.path)
        except BaseException:
            if os.path.exists(tmp_path):
                os.remove(tmp_path)
            raise
        return dropped

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for writer in self._tb_writers.values():
            writer.close()
        self._tb_writers.clear()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _host_scalar(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic)) and value.size == 1:
        return value.reshape(()).item()
    return value


def _format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return f"{float(value):.4g}"
    return str(value)


def status_line(line: str, *, process_index: int | None = None,
                file: TextIO | None = None) -> None:
    """One plain progress line on process 0's stderr, flushed (a log file shows it as it
    happens): for a long call with no steps to count, such as an evaluation. Silent on other
    processes."""
    process_index = jax.process_index() if process_index is None else process_index
    if process_index == 0:
        print(line, file=sys.stderr if file is None else file, flush=True)


class ProgressBar:
    """Training progress on process 0, with a few live metrics.

    On a terminal, a tqdm bar. Elsewhere (batch jobs, TPU worker logs) one plain line, without
    carriage returns, for a step reported with metrics at most every `interval_s` seconds, and
    always for the last step:

        [ppo] step 40/120 (33%)  1.52 steps/s  scores=0.412 kl=3.1  eta 0:00:52

    (steps/s over the steps since the previous line). Silent on other processes.

    Args:
      total: the step the run ends at; initial: the step it starts (or resumes) from.
      desc: the stage name shown first.
      keys: the row values to show, in order; None = every value of the row (callers pass
        only the metrics they want shown).
      interval_s: the least time between two plain lines.
      clock: seconds as a float, monotonic (injectable for tests).
    """

    def __init__(self, total: int, *, initial: int = 0, desc: str | None = None,
                 keys: Sequence[str] | None = None, process_index: int | None = None,
                 file: TextIO | None = None, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self._file = sys.stderr if file is None else file
        process_index = jax.process_index() if process_index is None else process_index
        isatty = getattr(self._file, "isatty", None)
        self.active = process_index == 0
        self.terminal = self.active and bool(isatty and isatty())
        self._keys = None if keys is None else tuple(keys)
        self._total, self._desc = total, desc
        self._interval_s, self._clock = interval_s, clock
        self._shown = ""
        self._last_step, self._last_time = initial, clock()
        self._bar = tqdm.tqdm(total=total, initial=initial, desc=desc, file=self._file,
                              disable=not self.terminal, dynamic_ncols=True)

    def update(self, step: int, row: Mapping[str, Any] | None = None) -> None:
        """Moves to `step`; a `row` (a logged step) updates the metrics shown."""
        if not self.active:
            return
        if row is not None:
            self._shown = self._format_metrics(row)
        if self.terminal:
            if row is not None:
                self._bar.set_postfix_str(self._shown, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        now = self._clock()
        due = step >= self._total or (row is not None
                                      and now - self._last_time >= self._interval_s)
        if due and step > self._last_step:
            self._print_line(step, now)

    def _format_metrics(self, row: Mapping[str, Any]) -> str:
        shown = [k for k in (row if self._keys is None else self._keys) if k in row]
        values = jax.device_get([row[k] for k in shown])
        return " ".join(f"{k.rsplit('/', 1)[-1]}={_format_value(_to_json_value(k, v))}"
                        for k, v in zip(shown, values))

    def _print_line(self, step: int, now: float) -> None:
        parts = [f"step {step}/{self._total} ({100 * step // max(self._total, 1)}%)"]
        elapsed = now - self._last_time
        rate = (step - self._last_step) / elapsed if elapsed > 0 else 0.0
        if rate > 0:
            parts.append(f"{rate:.3g} steps/s")
        if self._shown:
            parts.append(self._shown)
        if rate > 0:
            eta = round(max(self._total - step, 0) / rate)
            parts.append(f"eta {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}")
        prefix = f"[{self._desc}] " if self._desc else ""
        self._file.write(prefix + "  ".join(parts) + "\n")
        self._file.flush()
        self._last_step, self._last_time = step, now

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def summary_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """Plain-text table of `columns` for each row; numbers right-aligned (4 significant digits),
    missing values as "-"."""
    rows = [{key: _host_scalar(value) for key, value in jax.device_get(dict(row)).items()}
            for row in rows]
    columns = list(columns)
    if not columns:
        raise ValueError("columns must name at least one column")
    cells = [[_format_value(row.get(column)) for column in columns] for row in rows]
    numeric = [all(row.get(column) is None or (isinstance(row.get(column), numbers.Number)
                                               and not isinstance(row.get(column), bool))
                   for row in rows)
               for column in columns]
    widths = [max([len(column)] + [len(line[i]) for line in cells])
              for i, column in enumerate(columns)]

    def render(values: Sequence[str]) -> str:
        return "  ".join(value.rjust(width) if is_num else value.ljust(width)
                         for value, width, is_num in zip(values, widths, numeric)).rstrip()

    lines = [render(columns), "  ".join("-" * width for width in widths)]
    lines.extend(render(line) for line in cells)
    return "\n".join(lines)
