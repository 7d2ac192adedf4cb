"""SFT -> MA-PPO on APPS with unit-test rewards and SmolLM2-135M-Instruct, sized for a CPU.

    python experiments/run.py --config=configs/apps_smollm2.py \\
        --config.task.path=/data/apps --workdir=runs/apps_smollm2
    python experiments/run.py --config=configs/apps_smollm2.py --config.stage=eval \\
        --config.task.path=/data/apps --workdir=runs/apps_smollm2      # pass@1, pass@5

Data: `config.task.path` is a local directory in the public schema of codeparrot/apps
(`train.jsonl` and `test.jsonl` with `problem_id`, `question`, `solutions`, `input_output`,
`difficulty`, `url`, `starter_code`); required offline, empty reads the hub's json files.

There is no reward model: the PPO reward of a program is the fraction of its problem's unit
tests it passes (`config.ppo.reward_source="host"`), run in the sandbox of marl_jax.eval.apps
with `config.task.unit_test_timeout_s` per test; the critic starts from the SFT backbone.
Sampling follows the paper's APPS runs (temperature 1.0, top-k 5) and macros are fixed
10-grams. Evaluation reports pass@1 and pass@5 from `config.eval.num_samples` programs per
held-out (test) problem.
"""
from configs.tldr_smollm2 import smollm2_config


def get_config():
    c = smollm2_config("apps")
    c.task.max_prompt_length = 256
    c.task.unit_test_timeout_s = 4.0
    c.rm.steps = 0
    p = c.ppo
    p.reward_source = "host"
    p.critic_init = "sft"
    p.temperature = 1.0
    p.top_k = 5
    p.ngram = 10
    p.response_length = 128
    c.eval.judge = "none"
    c.eval.num_samples = 5
    c.eval.pass_at_k = (1, 5)
    c.eval.max_prompts = 8
    return c
