"""Randomly initialised policies of published shapes, for benchmarks that need no checkpoint.

`SHAPES` holds the decoder fields of each shape; `random_policy(name, ...)` builds the policy
module through the project's own config path (`build.model_config`) and initialises its float32
parameters, so the benchmarks time the programs a run compiles.
"""
import dataclasses

import jax
import numpy as np

SHAPES = {
    # SmolLM2-135M.
    "smollm2": dict(family="llama", hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                    num_kv_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                    tie_word_embeddings=True),
    # Gemma-2B (the paper's TL;DR model).
    "gemma2b": dict(family="gemma", hidden_size=2048, intermediate_size=16384, num_layers=18, num_heads=8,
                    num_kv_heads=1, head_dim=256, vocab_size=256000, max_position_embeddings=8192),
    # A CPU-sized Llama and a smoke-test one.
    "cpu": dict(family="llama", hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=4,
                head_dim=64, vocab_size=8192, max_position_embeddings=2048, tie_word_embeddings=True),
    "small": dict(family="llama", hidden_size=64, intermediate_size=192, num_layers=2, num_heads=2, num_kv_heads=2,
                  head_dim=32, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True),
}


class Vocabulary:
    """What `build.model_config` reads from a tokenizer, for a model without one."""

    def __init__(self, size: int):
        self.size, self.eos_token_id, self.pad_token_id, self.bos_token_id = size, 1, 0, 2

    def __len__(self):
        return self.size


# ModelConfig fields a run sets itself (numerics, token ids, adapters), not the architecture's.
_RUN_FIELDS = ("dtype", "param_dtype", "remat", "scan_layers", "scan_unroll", "attention", "matmul_precision",
               "sampler_layout", "fused_projections", "bos_token_id", "eos_token_id", "pad_token_id", "lora_rank",
               "lora_alpha", "lora_dropout", "lora_targets")


def model_settings(shape: str, dtype: str, *, remat="none", scan_layers: bool = True, attention: str = "auto",
                   matmul_precision: str = "auto", sampler_layout: str = "auto"):
    """The run config (`config.base_config()`) of a random policy of `shape`, its architecture
    fields those of the shape's family (`ModelConfig.for_family`)."""
    from marl_jax.config import base_config
    from marl_jax.models.config import ModelConfig

    fields = dict(SHAPES[shape])
    arch = dataclasses.asdict(ModelConfig.for_family(fields.pop("family"), **fields))
    config = base_config()
    config.model.config.update({k: v for k, v in arch.items() if k not in _RUN_FIELDS})
    config.model.update(dtype=dtype, remat=remat, scan_layers=scan_layers, attention=attention,
                        matmul_precision=matmul_precision, sampler_layout=sampler_layout)
    return config


def random_policy(config, key: int = 0):
    """(policy module, float32 params, parameter count) of the model `config.model` describes."""
    from marl_jax import models
    from marl_jax.train import build

    module = build.policy_module(build.model_config(config, Vocabulary(config.model.config.vocab_size)))
    params = jax.jit(lambda k: models.init_params(module, k))(jax.random.key(key))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return module, params, count
