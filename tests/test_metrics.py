"""MetricsWriter (metrics.jsonl + TensorBoard), truncate_after on resume, ProgressBar, summary_table."""
import glob
import io
import json
import math
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from marl_jax.train import metrics


def _strict_json(line):
    def reject(token):
        raise AssertionError(f"non-standard JSON token {token}")
    return json.loads(line, parse_constant=reject)


def _lines(workdir):
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return f.read().splitlines()


def _read_events(path):
    """Events of one TensorBoard event file (TFRecord framing: length, crc, payload, crc)."""
    events = []
    with open(path, "rb") as f:
        data = f.read()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset:offset + 8])
        payload = data[offset + 12:offset + 12 + length]
        offset += 12 + length + 4
        event = event_pb2.Event()
        event.ParseFromString(payload)
        events.append(event)
    return events


def _scalars(run_dir):
    """{tag: [(step, value), ...]} over all event files of a run, in file order."""
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
        for event in _read_events(path):
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_rows_are_strict_json_with_python_scalars(tmp_path):
    writer = metrics.MetricsWriter(tmp_path, process_index=0)
    writer.write({"stage": "ppo", "step": np.int64(1), "objective/kl": np.float32(0.1),
                  "objective/scores": jnp.asarray(2.5), "loss/value_avg": float("nan"),
                  "val/ratio": float("inf"), "lr": -math.inf, "arm": "ma_ppo", "seed": 3,
                  "ended_with_eos": True, "note": None, "tokens": np.asarray([7]),
                  "gold_per_prompt": [0.5, np.float32(-1.0), float("nan")],
                  "grid": jnp.asarray([[1, 2], [3, 4]])})
    # Visible on disk before close: a killed run keeps what it logged.
    (line,) = _lines(tmp_path)
    row = _strict_json(line)
    assert row == {"stage": "ppo", "step": 1, "objective/kl": float(np.float32(0.1)),
                   "objective/scores": 2.5, "loss/value_avg": "NaN", "val/ratio": "Infinity",
                   "lr": "-Infinity", "arm": "ma_ppo", "seed": 3, "ended_with_eos": True,
                   "note": None, "tokens": [7], "gold_per_prompt": [0.5, -1.0, "NaN"],
                   "grid": [[1, 2], [3, 4]]}
    assert type(row["step"]) is int
    writer.close()
    (read,) = metrics.read_metrics(tmp_path)
    assert math.isnan(read["loss/value_avg"]) and read["val/ratio"] == math.inf
    assert read["lr"] == -math.inf and read["objective/kl"] == float(np.float32(0.1))
    assert read["gold_per_prompt"][:2] == [0.5, -1.0] and math.isnan(read["gold_per_prompt"][2])


def test_bad_rows(tmp_path):
    with metrics.MetricsWriter(tmp_path, process_index=0) as writer:
        with pytest.raises(ValueError, match="missing 'step'"):
            writer.write({"stage": "sft", "loss": 1.0})
        with pytest.raises(ValueError, match=r"row\['step'\]=1.5 must be an int"):
            writer.write({"stage": "sft", "step": 1.5})
        with pytest.raises(ValueError, match="metric 'cfg.seed' has unsupported type object"):
            writer.write({"stage": "sft", "step": 1, "cfg": {"seed": object()}})
    assert metrics.read_metrics(tmp_path) == []


def _write_ppo_rows(writer, arm, steps):
    for step in steps:
        writer.write({"stage": "ppo", "step": step, "arm": arm, "seed": 0,
                      "objective/kl": 0.1 * step, "objective/scores": float(step)})


def test_truncate_after_drops_only_matching_later_rows(tmp_path):
    with metrics.MetricsWriter(tmp_path, process_index=0) as writer:
        writer.write({"stage": "sft", "step": 9, "loss": 1.0})
        _write_ppo_rows(writer, "ppo", range(1, 6))
        _write_ppo_rows(writer, "ma_ppo", range(1, 6))
    # A resumed run of arm ma_ppo restores its step-3 checkpoint.
    with metrics.MetricsWriter(tmp_path, process_index=0) as writer:
        assert writer.truncate_after("ppo", 3, arm="ma_ppo", seed=0) == 2
        assert writer.truncate_after("ppo", 3, arm="ma_ppo", seed=0) == 0
        _write_ppo_rows(writer, "ma_ppo", range(4, 6))
    rows = metrics.read_metrics(tmp_path)
    assert [(r["stage"], r.get("arm"), r["step"]) for r in rows] == (
        [("sft", None, 9)] + [("ppo", "ppo", s) for s in range(1, 6)]
        + [("ppo", "ma_ppo", s) for s in range(1, 6)])
    assert [r["step"] for r in metrics.read_metrics(tmp_path, stage="sft")] == [9]
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "tb"]  # no temporary file left
    for line in _lines(tmp_path):
        _strict_json(line)

    with metrics.MetricsWriter(tmp_path, process_index=0, tensorboard=False) as writer:
        assert writer.truncate_after("ppo", 1) == 8
    assert [(r["stage"], r["step"]) for r in metrics.read_metrics(tmp_path)] == [
        ("sft", 9), ("ppo", 1), ("ppo", 1)]


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    with metrics.MetricsWriter(tmp_path, process_index=0) as writer:
        _write_ppo_rows(writer, "ma_ppo", range(1, 4))
        writer.write({"stage": "sft", "step": 2, "loss": np.float32(0.75), "ok": True, "tag": "x",
                      "per_prompt": [1.0, 2.0]})
    run_dir = os.path.join(tmp_path, "tb", "ppo", "arm=ma_ppo,seed=0")
    scalars = _scalars(run_dir)
    assert set(scalars) == {"objective/kl", "objective/scores"}
    assert scalars["objective/scores"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    np.testing.assert_allclose([v for _, v in scalars["objective/kl"]], [0.1, 0.2, 0.3], rtol=1e-6)
    assert _scalars(os.path.join(tmp_path, "tb", "sft")) == {"loss": [(2, 0.75)]}

    with metrics.MetricsWriter(tmp_path, process_index=0) as writer:
        writer.truncate_after("ppo", 1, arm="ma_ppo", seed=0)
        _write_ppo_rows(writer, "ma_ppo", [2])
    files = glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    assert len(files) == 2
    # TensorBoard hides older events at steps >= 2 after this marker, which only the new file has.
    (new_events,) = [events for events in map(_read_events, files)
                     if any(e.session_log.status == event_pb2.SessionLog.START for e in events)]
    assert [e.step for e in new_events if e.session_log.status == event_pb2.SessionLog.START] == [2]
    assert [(e.step, e.summary.value[0].simple_value) for e in new_events
            if e.summary.value and e.summary.value[0].tag == "objective/scores"] == [(2, 2.0)]


def test_non_zero_process_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    with metrics.MetricsWriter(workdir, process_index=1) as writer:
        writer.write({"stage": "ppo", "step": 1, "objective/kl": 0.5})
        assert writer.truncate_after("ppo", 0) == 0
    assert not workdir.exists()
    assert metrics.read_metrics(workdir) == []


def test_partial_last_line_from_a_killed_writer(tmp_path):
    with metrics.MetricsWriter(tmp_path, process_index=0, tensorboard=False) as writer:
        writer.write({"stage": "sft", "step": 1, "loss": 2.0})
    with open(os.path.join(tmp_path, "metrics.jsonl"), "a", encoding="utf-8") as f:
        f.write('{"stage": "sft", "st')
    assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1]
    with metrics.MetricsWriter(tmp_path, process_index=0, tensorboard=False) as writer:
        writer.write({"stage": "sft", "step": 2, "loss": 1.0})
    assert [_strict_json(line)["step"] for line in _lines(tmp_path)] == [1, 2]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_of_process_zero():
    terminal = _Terminal()
    with metrics.ProgressBar(10, initial=2, desc="ppo", keys=("objective/scores", "objective/kl"),
                             process_index=0, file=terminal) as bar:
        assert bar.terminal
        bar.update(3, {"objective/scores": np.float32(1.25), "objective/kl": jnp.asarray(0.5),
                       "loss/value_avg": 9.0})
    text = terminal.getvalue()
    assert "ppo" in text and "scores=1.25 kl=0.5" in text and "3/10" in text
    assert "value_avg" not in text

    terminal = _Terminal()
    with metrics.ProgressBar(10, desc="sft", process_index=0, file=terminal) as bar:
        bar.update(4, {"loss": 0.125, "accuracy": 0.75})  # no keys: every value of the row
    assert "loss=0.125 accuracy=0.75" in terminal.getvalue()

    terminal = _Terminal()
    with metrics.ProgressBar(10, process_index=1, file=terminal) as bar:
        assert not bar.active and not bar.terminal
        bar.update(5, {"objective/kl": 0.5})
    assert terminal.getvalue() == ""


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_progress_lines_off_a_terminal():
    """Plain lines for logged steps at most every interval_s, always at the last step."""
    out, clock = io.StringIO(), _Clock()
    bar = metrics.ProgressBar(120, desc="ppo", process_index=0, file=out, clock=clock)
    assert bar.active and not bar.terminal

    def at(t, step, row=None):
        clock.now = t
        bar.update(step, row)

    at(10.0, 10, {"objective/scores": 0.5, "objective/kl": 1.0})  # 10 s after the start: quiet
    at(31.0, 11)                                                   # not a logged step: quiet
    # 20 steps in 40 s: 0.5 steps/s, 100 steps left -> 200 s.
    at(40.0, 20, {"objective/scores": 0.412, "objective/kl": 3.1})
    at(60.0, 30, {"objective/scores": 0.3, "objective/kl": 3.0})  # 20 s after the last line
    # 20 steps in 30.5 s: 0.6557 steps/s, 80 steps left -> 80 * 30.5 / 20 = 122 s.
    at(70.5, 40, {"objective/scores": np.float32(0.25), "objective/kl": jnp.asarray(2.0)})
    at(71.0, 41)
    # The last step always gets a line: 80 steps in 29.5 s = 2.712 steps/s.
    at(100.0, 120, {"objective/scores": 1.0, "objective/kl": 4.0})
    bar.close()
    assert out.getvalue() == (
        "[ppo] step 20/120 (16%)  0.5 steps/s  scores=0.412 kl=3.1  eta 0:03:20\n"
        "[ppo] step 40/120 (33%)  0.656 steps/s  scores=0.25 kl=2  eta 0:02:02\n"
        "[ppo] step 120/120 (100%)  2.71 steps/s  scores=1 kl=4  eta 0:00:00\n")


def test_progress_lines_resume_interval_and_long_eta():
    out, clock = io.StringIO(), _Clock()
    bar = metrics.ProgressBar(100_002, initial=2, desc="sft", process_index=0, file=out,
                              interval_s=5.0, clock=clock)
    clock.now = 4.0
    bar.update(3, {"loss": 2.5})
    clock.now = 6.0
    bar.update(4, {"loss": 2.25})  # resumed at step 2: 2 steps in 6 s, 99998 left -> 299994 s
    assert out.getvalue() == "[sft] step 4/100002 (0%)  0.333 steps/s  loss=2.25  eta 83:19:54\n"

    quiet = io.StringIO()
    bar = metrics.ProgressBar(10, process_index=1, file=quiet, clock=clock)
    bar.update(10, {"loss": 1.0})
    bar.close()
    assert quiet.getvalue() == ""


def test_summary_table():
    rows = [{"arm": "ppo", "step": 100, "objective/scores": 1.23456, "win": None},
            {"arm": "ma_ppo", "step": 100, "objective/scores": np.float32(2.5)}]
    assert metrics.summary_table(rows, ["arm", "step", "objective/scores", "win"]) == "\n".join([
        "arm     step  objective/scores  win",
        "------  ----  ----------------  ---",
        "ppo      100             1.235    -",
        "ma_ppo   100               2.5    -",
    ])
    with pytest.raises(ValueError, match="columns"):
        metrics.summary_table(rows, [])


def test_nested_dicts_round_trip(tmp_path):
    row = {"stage": "plan", "step": 0, "controls": {"ma_ppo": "ma_ppo_ctrl"},
           "runs": {"ppo": {"lam": 0.95, "mean_macro_length": None, "kl": float("nan")}}}
    with metrics.MetricsWriter(tmp_path, process_index=0) as writer:
        writer.write(row)
    back = metrics.read_metrics(tmp_path)[0]
    assert back["controls"] == {"ma_ppo": "ma_ppo_ctrl"}
    assert back["runs"]["ppo"]["lam"] == 0.95 and back["runs"]["ppo"]["mean_macro_length"] is None
    assert np.isnan(back["runs"]["ppo"]["kl"])


def test_status_line_is_one_flushed_line_on_process_zero_only():
    class Log(io.StringIO):
        flushes = 0

        def flush(self):
            Log.flushes += 1
            super().flush()

    log = Log()
    metrics.status_line("[eval] 512 held-out responses", process_index=0, file=log)
    metrics.status_line("[eval] from process 1", process_index=1, file=log)
    assert log.getvalue() == "[eval] 512 held-out responses\n" and Log.flushes >= 1
