"""SFT -> reward model -> MA-PPO on Anthropic HH-RLHF with SmolLM2-135M-Instruct, sized for a CPU.

    python experiments/run.py --config=configs/hh_rlhf_smollm2.py \\
        --config.task.path=/data/full-hh-rlhf --workdir=runs/hh_rlhf_smollm2

Data: `config.task.path` is a local directory in the public schema of Dahoas/full-hh-rlhf
(`train.jsonl` / `test.jsonl` or the hub's parquet files with `prompt`, `response`, `chosen`,
`rejected`); required offline, empty reads the hub copy. The dialogue is given to the model
through its chat template (one turn per Human / Assistant message). Held-out prompts come from
the test split. Everything else as configs/tldr_smollm2.py (fixed 5-gram macros).
"""
from configs.tldr_smollm2 import smollm2_config


def get_config():
    c = smollm2_config("hh_rlhf")
    c.eval.judge = "rm"
    return c
