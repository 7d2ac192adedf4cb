"""The paper's TL;DR run with Gemma-7B on a TPU slice: SFT -> reward model -> MA-PPO (n = 5).

    python experiments/run.py --config=configs/tldr_gemma7b_tpu.py --workdir=gs://.../tldr_7b

Everything as configs/tldr_gemma2b_tpu.py (the released Gemma-2B settings; model path: the hub
name "google/gemma-7b" or a local HF directory), with Gemma-7B. kl_coef stays 0.05: the paper
raises it to 0.1 for WebGPT at 7B and for its 27B runs, not for TL;DR at 7B (METHOD.md).
Memory: each trained model (actor, critic) holds float32 weights and Adam moments, about 100 GB
for 8.5B parameters, and the frozen reference and reward model 34 GB each: about 270 GB before
activations, sharded over the slice (fsdp). Sized for a v4-64 slice (32 chips of 32 GiB), the
PPO update in micro-batches; `python experiments/bench.py memory --config=...` checks the fit
(docs/scaling.md has the numbers).
"""
from configs.tldr_gemma2b_tpu import gemma_tldr_config


def get_config():
    return gemma_tldr_config("google/gemma-7b", tpu_topology="v4-64", kl_coef=0.05,
                             grad_accum_steps=2)
