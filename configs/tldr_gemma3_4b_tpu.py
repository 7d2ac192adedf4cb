"""TL;DR MA-PPO with Gemma 3 4B on a TPU slice: SFT -> reward model -> MA-PPO (n = 5).

    python experiments/run.py --config=configs/tldr_gemma3_4b_tpu.py --workdir=gs://.../tldr_g3_4b

Everything as configs/tldr_gemma2b_tpu.py (the released Gemma-2B settings), with Gemma 3's 4B
text decoder: 34 layers, five of every six attending to a 1,024-token window (local rope base
10,000), every sixth global (rope base 1,000,000, linear scaling 8), q/k norms, a 262k
vocabulary. `config.model.path`: a local HF directory of the text decoder (`Gemma3ForCausalLM`:
config.json with model_type "gemma3_text", *.safetensors, tokenizer files), e.g. the language
model of google/gemma-3-4b-pt saved on its own; the table entry of that name sizes the run
offline. Memory: actor and critic hold float32 weights and Adam moments (16 bytes x 3.9 B each,
124 GB), the frozen reference and reward model 16 GB each: about 155 GB before activations,
sharded over the slice (fsdp). Sized for a v4-32 slice (16 chips of 32 GiB), the PPO update in
two micro-batches; `python experiments/bench.py memory --config=configs/tldr_gemma3_4b_tpu.py`
checks the fit (docs/scaling.md has the numbers).
"""
from configs.tldr_gemma2b_tpu import gemma_tldr_config


def get_config():
    return gemma_tldr_config("google/gemma-3-4b-pt", tpu_topology="v4-32", kl_coef=0.05, grad_accum_steps=2)
