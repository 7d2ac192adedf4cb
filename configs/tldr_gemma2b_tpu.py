"""The paper's TL;DR run with Gemma-2B on a TPU slice: SFT -> reward model -> MA-PPO (n = 5).

    python experiments/run.py --config=configs/tldr_gemma2b_tpu.py --workdir=gs://.../tldr_2b
    python experiments/run.py --config=configs/tldr_gemma2b_tpu.py --config.stage=eval ...
    # token-level PPO control: --config.ppo.ngram=1

Model: `config.model.path` is a Hugging Face Hub name ("google/gemma-2b", downloaded once into
the hub cache; the model is gated: accept its licence and set HF_TOKEN) or a local directory
with config.json, *.safetensors and the tokenizer files. Data: empty `config.task.path` reads
openai/summarize_from_feedback from the hub; offline, point it at a local copy in the same
schema. Multi-host slices: launch on every worker (tpu_scripts/), each host reads the data.

PPO is the released MA-RLHF TL;DR Gemma-2B run (METHOD.md, the official run_gemma.sh): batch
256 prompts, 1 PPO epoch, clip 0.2 / 0.2, lam 0.95, gamma 1, kl_coef 0.05, reward clip 2.5,
Adam (0.9, 0.95), weight decay 0.1, linear LR 1.5e-5 (actor and critic) with 5% warmup, grad
clip 1.0, prompt / response 512 / 512 tokens, temperature 0.8, top-k 50, fixed 5-gram macros with
`equal` weighting; critic and frozen reward model from the reward model, actor and reference
from SFT; 20 / 40 / 40 split with seed 1234. 145 PPO steps are one pass over the 37,143 RL rows
of that split (the distinct posts among them, each sampled about 2.5 times as in the official
run, which feeds rows with repeated posts). SFT and the reward model follow the official
DeepSpeed-Chat scripts (SFT: LR 5e-5 cosine, 10% warmup, weight decay 0.01, 1 epoch; RM: LR
7.5e-6 cosine, 5% warmup, weight decay 0.1, 2 epochs) at batch 64. Evaluation: mean RM score of
2,000 validation responses; pairwise judge on 50 (openai: set MARL_JUDGE_MODEL, e.g. gpt-4).

Compute in bfloat16 with float32 master weights, rematerialised layers in one scan, parameters
and optimizer state sharded over all chips (fsdp). Sized for a v4-16 slice (8 chips of 32 GiB):
`python experiments/bench.py memory --config=configs/tldr_gemma2b_tpu.py` compiles every stage
for it with the TPU compiler and reports the per-chip peak (docs/scaling.md).
"""
from marl_jax.config import base_config

TLDR_TRAIN_ROWS = 92_858  # openai/summarize_from_feedback "comparisons" train split


def gemma_tldr_config(model_path: str, *, tpu_topology: str, kl_coef: float = 0.05,
                      grad_accum_steps: int = 1):
    c = base_config()
    c.stage = "all"
    c.seed = 1234
    c.checkpoint_every = 50
    c.log_every = 1
    # The slice this config is sized for: `python experiments/bench.py memory --config=...`
    # compiles every stage for it and checks the fit (docs/scaling.md has the numbers).
    c.tpu_topology = tpu_topology

    c.mesh.update(dict(data=1, fsdp=-1, tensor=1))

    c.model.path = model_path
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = "full"
    c.model.scan_layers = True

    t = c.task
    t.name = "tldr"
    t.path = ""
    t.use_chat_template = False  # base model, the public TL;DR prompt format
    t.max_prompt_length = 512
    t.num_eval_prompts = 2000

    sft_rows, rm_rows, rl_rows = (round(f * TLDR_TRAIN_ROWS) for f in (0.2, 0.4, 0.4))
    c.sft.update(dict(steps=sft_rows // 64, batch_size=64, learning_rate=5e-5,
                      schedule="cosine", warmup_ratio=0.1, weight_decay=0.01))
    c.rm.update(dict(steps=2 * rm_rows // 64, batch_size=64, learning_rate=7.5e-6,
                     schedule="cosine", warmup_ratio=0.05, weight_decay=0.1))

    p = c.ppo
    p.steps = rl_rows // 256
    p.batch_size = 256  # prompts per rollout, as released; micro-batches only split the update
    p.grad_accum_steps = grad_accum_steps
    p.learning_rate = 1.5e-5
    p.critic_learning_rate = 1.5e-5
    p.warmup_ratio = 0.05
    p.schedule = "linear"
    p.weight_decay = 0.1
    p.response_length = 512
    p.temperature = 0.8
    p.top_k = 50
    p.top_p = 1.0
    p.kl_coef = kl_coef
    p.termination = "fixed"
    p.ngram = 5
    p.value_weighting = "equal"
    p.critic_init = "rm"
    p.eval_every = 10

    c.eval.max_prompts = 2000
    c.eval.batch_size = 256
    c.eval.judge = "rm"
    c.eval.judge_max_samples = 50
    return c


def get_config():
    return gemma_tldr_config("google/gemma-2b", tpu_topology="v4-16")
