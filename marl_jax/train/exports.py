"""Exports: the trained models of a workdir as transformers-loadable directories.

`<workdir>/models/{sft,rm,policy}` each follow a stage's checkpoints (`sft`, `rm`, `ppo`). An
export records in `export_info.json` the checkpoint step it came from and that checkpoint's
commit id, so a stage that continues (more steps) or is retrained replaces its export, files that
belong to the model (the reward statistics) are recomputed with it, and the eval stage can refuse
an export older than the last checkpoint. An export directory is complete or absent: it is
written beside its final place and renamed into it.
"""
from __future__ import annotations

import json
import os
import shutil

import jax

from marl_jax import distributed, models
from marl_jax.models import lora, peft_export
from marl_jax.train import checkpoint, preemption

# The reward model's score mean and std over its training responses, saved beside it so PPO
# (and anyone serving it) can centre and scale its scores.
REWARD_STATS = "reward_stats.json"
EXPORT_INFO = "export_info.json"
# A LoRA export's adapter in PEFT format, beside the merged model.
ADAPTER_DIR = "adapter"
# The pretrained base of a LoRA run whose model was built from its config (no checkpoint to
# point the SFT adapter at).
BASE_EXPORT = "base"
# The checkpoint stage each export follows.
EXPORT_STAGES = {"sft": "sft", "rm": "rm", "policy": "ppo"}


def export_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, "models", name)


def latest_checkpoint_step(workdir: str, stage: str) -> int:
    """The step of `<workdir>/checkpoints/<stage>`'s latest complete checkpoint (0: none)."""
    return checkpoint.latest_step(checkpoint.checkpoint_dir(workdir, stage)) or 0


def read_export_info(path: str):
    """The `export_info.json` of an export directory (None when absent or unreadable)."""
    try:
        with open(os.path.join(path, EXPORT_INFO)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def export_info(workdir: str, name: str) -> dict:
    """What an export of `<workdir>/models/<name>` made now would record: the stage, its
    latest checkpoint step and that checkpoint's commit id."""
    stage = EXPORT_STAGES[name]
    step = latest_checkpoint_step(workdir, stage)
    return {"stage": stage, "checkpoint_step": step, "checkpoint_id": checkpoint.commit_id(
        checkpoint.checkpoint_dir(workdir, stage), step) if step else ""}


def current_export_file(workdir: str, name: str, filename: str):
    """The JSON `filename` of `<workdir>/models/<name>` when that export was made from its
    stage's latest checkpoint, else None."""
    path = export_dir(workdir, name)
    file = os.path.join(path, filename)
    if not distributed.main_process_value(read_export_info(path) == export_info(workdir, name)
                                          and os.path.isfile(file)):
        return None
    with open(file) as f:
        return json.load(f)


def export_model(workdir: str, name: str, module, params, tokenizer, extra=None,
                 adapter_base: str | None = None) -> None:
    """Writes `<workdir>/models/<name>` (weights, config, tokenizer, `extra` JSON files) of
    `params`, the state of the stage's latest checkpoint, unless it already holds that
    checkpoint. Every process takes part (the params are gathered); process 0 writes.

    LoRA params are exported merged (a plain transformers model) and, given `adapter_base`
    (the directory of the base they apply to), also as a PEFT adapter in `<export>/adapter/`.

    A preemption notice stops the run after the export is renamed into place (a safe point of
    every process, `preemption.safe_point`)."""
    path = export_dir(workdir, name)
    info = export_info(workdir, name)
    if distributed.main_process_value(read_export_info(path) == info):
        return
    params = distributed.global_to_host(params)
    if jax.process_index() == 0:
        _write_export(path, info, module, params, tokenizer, extra, adapter_base)
    preemption.safe_point(f"after the export of {path}")


def _write_export(path: str, info: dict, module, params, tokenizer, extra, adapter_base) -> None:
    """Writes the export beside `path` and renames it into place."""
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    if lora.has_adapters(params):
        if adapter_base is not None:
            peft_export.save_adapter(module.config, params, os.path.join(tmp, ADAPTER_DIR),
                                     adapter_base)
        params = lora.merge(params, lora.settings(module.config),
                            precision=module.config.precision)
    models.save_pretrained(module, params, tmp)
    tokenizer.save_pretrained(tmp)
    for filename, content in dict(extra or {}, **{EXPORT_INFO: info}).items():
        with open(os.path.join(tmp, filename), "w") as f:
            json.dump(content, f, indent=2)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def check_export_current(workdir: str, name: str) -> None:
    """Raises ValueError unless `<workdir>/models/<name>` was exported from its stage's latest
    checkpoint, by step and by that checkpoint's commit id (an older export, or one of an
    earlier training to the same step, would be scored as the checkpoint's)."""
    path = export_dir(workdir, name)
    current = export_info(workdir, name)
    info = read_export_info(path) or {}
    if all(info.get(key) == current[key] for key in ("stage", "checkpoint_step", "checkpoint_id")):
        return
    what = ("an unknown checkpoint" if "checkpoint_step" not in info else
            f"step {info['checkpoint_step']} (checkpoint {info.get('checkpoint_id') or '?'})")
    stage = current["stage"]
    raise ValueError(
        f"{path} was exported from {what} but {workdir}/checkpoints/{stage} holds step "
        f"{current['checkpoint_step']} (checkpoint {current['checkpoint_id'] or '-'}); run "
        f"--config.stage={stage} (or all) with this workdir to export the latest checkpoint, "
        "then evaluate")
