"""SFT -> reward model -> MA-PPO on WebGPT comparisons with SmolLM2-135M-Instruct, sized for a CPU.

    python experiments/run.py --config=configs/webgpt_smollm2.py \\
        --config.task.path=/data/webgpt_comparisons --workdir=runs/webgpt_smollm2

Data: `config.task.path` is a local directory in the public schema of openai/webgpt_comparisons
(`train.jsonl` or the hub's parquet files with `question`, `answer_0`, `score_0`, `answer_1`,
`score_1`, ...); required offline, empty reads the hub copy. The dataset has a train split only,
so the held-out prompts are the last `num_eval_prompts` prompts of the RL part (never trained
on). Everything else as configs/tldr_smollm2.py (fixed 5-gram macros; the paper uses
kl_coef 0.1 for WebGPT only at 7B and 27B).
"""
from configs.tldr_smollm2 import smollm2_config


def get_config():
    c = smollm2_config("webgpt")
    c.task.eval_split = "heldout"
    return c
