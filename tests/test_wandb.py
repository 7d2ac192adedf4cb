"""Weights & Biases tracking through the one metrics writer: an offline run, read back from its
own files, carries the run's config and every metrics row of the JSONL; a missing package or
missing credentials fail in config validation, before anything compiles."""
import glob
import json
import struct
import sys

import pytest
from wandb.proto import wandb_internal_pb2

from marl_jax import stages
from marl_jax.config_check import validate_config
from marl_jax.train.metrics import MetricsWriter, read_metrics
from train_util import tiny_config

_BLOCK = 32768  # the .wandb file is a LevelDB-style log of 32 KiB blocks of records


def wandb_records(path):
    """The protobuf records of an offline run's `run-<id>.wandb` file, in order."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_run(wandb_dir):
    """(config, history rows) of the one offline run under `wandb_dir`."""
    files = glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    config, history = {}, []
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update((i.key, json.loads(i.value_json)) for i in record.run.config.update)
        elif kind == "config":
            config.update((i.key, json.loads(i.value_json)) for i in record.config.update)
        elif kind == "history":
            history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                            for i in record.history.item})
    return config, history


def test_an_offline_run_carries_the_config_and_every_metrics_row(tmp_path, monkeypatch):
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    config = tiny_config(stage="sft", **{"logging.wandb": True, "logging.wandb_mode": "offline",
                                         "logging.wandb_name": "tiny-sft"})
    workdir = tmp_path / "run"
    stages.run(config, str(workdir))
    logged, history = offline_run(wandb_dir)
    assert {k: v for k, v in logged.items() if k != "_wandb"} == json.loads(
        json.dumps(config.to_dict()))
    rows = read_metrics(workdir)
    assert [r["stage"] for r in rows] == ["sft"] * 4 and len(history) == len(rows)
    for row, entry in zip(rows, history):
        assert {k: v for k, v in entry.items() if not k.startswith("_")} == {
            k: v for k, v in row.items() if not isinstance(v, (list, dict)) and v is not None}


def test_wandb_without_the_package_or_credentials_fails_before_compiling(tmp_path, monkeypatch):
    config = tiny_config(**{"logging.wandb": True})
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    with pytest.raises(ValueError, match=r"^config\.logging\.wandb_mode='online' needs W&B "
                                         r"credentials: run `wandb login` .* or choose "
                                         r"--config\.logging\.wandb_mode=offline$"):
        validate_config(config)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    validate_config(config)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ValueError, match=r'^config\.logging\.wandb=True needs the wandb '
                                         r'package: pip install -e "\.\[wandb\]"'):
        validate_config(config)
    config.logging.wandb_mode = "sometimes"
    with pytest.raises(ValueError, match=r"^config\.logging\.wandb_mode='sometimes': must be"):
        validate_config(config)


def test_only_process_0_opens_a_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    config = tiny_config(**{"logging.wandb": True, "logging.wandb_mode": "offline"})
    with MetricsWriter(tmp_path / "run", process_index=1, logging=config.logging,
                       run_config=config.to_dict()) as writer:
        writer.write({"stage": "sft", "step": 1, "loss": 0.5})
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "run").exists()
    with MetricsWriter(tmp_path / "run", process_index=0, logging=config.logging,
                       run_config=config.to_dict()) as writer:
        writer.write({"stage": "sft", "step": 1, "loss": 0.5})
    _, history = offline_run(tmp_path)
    assert [{k: v for k, v in entry.items() if not k.startswith("_")} for entry in history] == [
        {"stage": "sft", "step": 1, "loss": 0.5}]
