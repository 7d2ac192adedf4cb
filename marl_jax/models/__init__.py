"""Decoder-only language models (GPT-2, Llama, Gemma, Gemma-2, Gemma 3, Qwen2, Qwen3, Mistral, OLMo-2
and Phi-3 families), value / reward heads, loading from Hugging Face directories and GGUF files,
saving back to Hugging Face format."""
from marl_jax.models.config import FAMILIES, ModelConfig
from marl_jax.models.decoder import Decoder, init_cache, positions_from_mask
from marl_jax.models.heads import (
    VALUE_HEAD_INIT_STD,
    CausalLM,
    ScalarHeadModel,
    forward_logits,
    last_token_score,
    reward_head_init_std,
)
from marl_jax.models.loading import build_model, load_pretrained
from marl_jax.models.params import compute_weights, init_params, logical_axes, stack_layers, unstack_layers
from marl_jax.models.saving import save_pretrained
from marl_jax.models.tokenizer import load_tokenizer

__all__ = [
    "FAMILIES",
    "VALUE_HEAD_INIT_STD",
    "CausalLM",
    "Decoder",
    "ModelConfig",
    "ScalarHeadModel",
    "build_model",
    "compute_weights",
    "forward_logits",
    "init_cache",
    "init_params",
    "last_token_score",
    "load_pretrained",
    "load_tokenizer",
    "logical_axes",
    "positions_from_mask",
    "reward_head_init_std",
    "save_pretrained",
    "stack_layers",
    "unstack_layers",
]
