"""The paper's largest TL;DR model, Gemma-2-27B, with LoRA on one v5e-8 host: SFT -> reward model
-> MA-PPO (n = 5).

    python experiments/run.py --config=configs/tldr_gemma2_27b_lora_v5e8.py --workdir=gs://.../27b
    python experiments/bench.py memory --config=configs/tldr_gemma2_27b_lora_v5e8.py

The released TL;DR settings of configs/tldr_gemma2b_tpu.py (batch 256 prompts, 512 + 512 tokens,
fixed 5-gram macros, clip 0.2 / 0.2, lam 0.95, the learning rates and schedules, the data split)
with kl_coef 0.1, the paper's value for its 27B runs. What changes to fit 8 chips of 16 GiB:
- LoRA rank 16, alpha 32 on every projection (q, k, v, o, gate, up, down); the base frozen in
  bfloat16, adapters and their Adam moments in float32. The actor, the critic and the reward
  model are adapters (plus heads) on one copy of the base, which is also the reference; SFT
  merges its adapter into that base.
- bfloat16 compute, rematerialised layers in one scan, everything sharded over the 8 chips
  (fsdp).
- Batches split, never shrunk: SFT and reward-model batches of 64 in 4 micro-batches, the PPO
  update in 16 micro-batches of 16 sequences, sampling in 8 chunks of 32 prompts (the KV cache of
  256 x 1024 tokens alone would be 12 GiB per chip).
The learning rates are the released full fine-tuning ones; LoRA runs usually take larger ones,
which this config does not tune. `python experiments/bench.py memory` compiles every stage for
a v5e-8 with the TPU compiler and reports each program's peak per chip and the headroom.
"""
from configs.tldr_gemma2b_tpu import gemma_tldr_config


def gemma2_lora_config(model_path: str, *, rank: int = 16, sft_micro_batches: int = 4,
                       ppo_micro_batches: int = 16, rollout_chunks: int = 8):
    c = gemma_tldr_config(model_path, tpu_topology="v5e-8", kl_coef=0.1,
                          grad_accum_steps=ppo_micro_batches)
    c.model.param_dtype = "bfloat16"  # the frozen base; adapters are float32 whatever this is
    c.model.lora.update(dict(rank=rank, alpha=2.0 * rank, targets=(), merge_sft=True))
    c.sft.grad_accum_steps = sft_micro_batches
    c.rm.grad_accum_steps = sft_micro_batches
    c.ppo.rollout_chunks = rollout_chunks
    return c


def get_config():
    return gemma2_lora_config("google/gemma-2-27b")
