"""The Weights & Biases run of a workdir, fed by the metrics writer (`marl_jax.train.metrics`).

`config.logging.wandb=True` opens one W&B run per workdir on process 0: the run's config once,
then every metrics row, with the JSONL's names (`stage`, `step`, `loss`, `objective/kl`, ...)
and W&B's own `_step` counting rows (stages and arms each restart `step`). Rows carry their
scalars only (numbers, booleans, strings); lists and dicts (per-prompt results, plans) stay in
the JSONL. The run id is kept in `<workdir>/wandb_run_id`, so running the same command again
resumes the same W&B run. Files go under $WANDB_DIR, else the workdir.
"""
from __future__ import annotations

import math
import os
import uuid
from collections.abc import Mapping
from typing import Any

RUN_ID_FILE = "wandb_run_id"
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class WandbRun:
    """A W&B run opened from the `config.logging` section `settings` with `run_config` as its
    config; `log(row)` takes the rows the metrics writer writes (JSON-encoded)."""

    def __init__(self, settings: Mapping[str, Any], run_config: Mapping[str, Any], workdir: str):
        import wandb

        id_file = os.path.join(workdir, RUN_ID_FILE)
        if os.path.exists(id_file):
            with open(id_file) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            with open(id_file, "w") as f:
                f.write(run_id + "\n")
        self._run = wandb.init(
            project=settings["wandb_project"], entity=settings["wandb_entity"] or None,
            name=settings["wandb_name"] or None, mode=settings["wandb_mode"],
            dir=os.environ.get("WANDB_DIR") or workdir, id=run_id, resume="allow",
            config=dict(run_config),
            # The run's own stdout stays as it is (progress lines, summary table).
            settings=wandb.Settings(console="off", quiet=True))

    def log(self, row: Mapping[str, Any]) -> None:
        self._run.log(scalars(row))

    def finish(self) -> None:
        import wandb

        self._run.finish()
        # W&B's service process writes the run's files after `finish` returns; `teardown` waits
        # for it, so a closed metrics writer leaves a complete run on disk.
        wandb.teardown()


def scalars(row: Mapping[str, Any]) -> dict[str, Any]:
    """The scalar values of a JSON-encoded metrics row, non-finite floats as floats again."""
    out = {}
    for key, value in row.items():
        if isinstance(value, (list, dict)) or value is None:
            continue
        out[key] = _NON_FINITE.get(value, value) if isinstance(value, str) else value
    return out
