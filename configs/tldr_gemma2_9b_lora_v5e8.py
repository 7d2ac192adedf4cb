"""Gemma-2-9B TL;DR with LoRA on one v5e-8 host: SFT -> reward model -> MA-PPO (n = 5).

    python experiments/run.py --config=configs/tldr_gemma2_9b_lora_v5e8.py --workdir=gs://.../9b
    python experiments/bench.py memory --config=configs/tldr_gemma2_9b_lora_v5e8.py

Everything as configs/tldr_gemma2_27b_lora_v5e8.py (released TL;DR settings, kl_coef 0.1, LoRA
rank 16 on every projection over one frozen bfloat16 base shared by actor, reference, critic
and reward model), with Gemma-2-9B, which needs fewer micro-batches: SFT and reward-model
batches in 2, the PPO update in 8, sampling in 4 chunks.
"""
from configs.tldr_gemma2_27b_lora_v5e8 import gemma2_lora_config


def get_config():
    return gemma2_lora_config("google/gemma-2-9b", sft_micro_batches=2, ppo_micro_batches=8,
                              rollout_chunks=4)
