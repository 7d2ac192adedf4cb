"""Architectures of well-known Hugging Face Hub models, for sizing a run without their files.

`HUB_CONFIGS` maps a hub name to its published `config.json`, reduced to the fields
`ModelConfig.from_hf` reads (sizes, norms, rope, tied embeddings, Gemma-2's soft-caps and
sliding window, Gemma 3's local / global layers, and the base models' token ids). Gemma 3 from 4B
up is published as an image-text checkpoint; the table holds its text decoder, which is what
`load_pretrained` reads of it. `hf_config(path)` resolves `config.model.path` offline: a local HF
directory's config.json, else the hub cache's copy of the name, else this table (image-text
configs reduced to their text decoder's).

Parameter counts (transformers' `num_parameters()`, tied embeddings counted once):
gemma-2b 2,506,172,416; gemma-7b 8,537,680,896; gemma-2-2b 2,614,341,888; gemma-2-9b
9,241,705,984; gemma-2-27b 27,227,128,320; Llama-3.2-1B 1,235,814,400; Llama-3.2-3B
3,212,749,824; Llama-3(.1)-8B 8,030,261,248; Qwen2.5-0.5B 494,032,768; Qwen2.5-1.5B
1,543,714,304; Qwen2.5-7B 7,615,616,512; SmolLM2-135M 134,515,008; gpt2 124,439,808;
Qwen3-0.6B 596,049,920; Qwen3-1.7B 1,720,574,976; Qwen3-4B 4,022,468,096; Qwen3-8B
8,190,735,360; Qwen3-14B 14,768,307,200; Qwen3-32B 32,762,123,264; gemma-3-270m 268,098,176;
gemma-3-1b 999,885,952; gemma-3-4b (text) 3,880,263,168; gemma-3-12b (text) 11,766,034,176;
gemma-3-27b (text) 27,009,346,304.
"""
from __future__ import annotations

import json
import os
import pathlib


def _gemma(**sizes) -> dict:
    return dict(model_type="gemma", vocab_size=256000, head_dim=256, hidden_act="gelu",
                max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
                attention_bias=False, tie_word_embeddings=True, initializer_range=0.02,
                bos_token_id=2, eos_token_id=1, pad_token_id=0, **sizes)


def _gemma2(**sizes) -> dict:
    return dict(model_type="gemma2", vocab_size=256000, hidden_act="gelu_pytorch_tanh",
                hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
                rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
                attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
                tie_word_embeddings=True, initializer_range=0.02, bos_token_id=2, eos_token_id=1,
                pad_token_id=0, **sizes)


_LLAMA3 = dict(model_type="llama", vocab_size=128256, hidden_act="silu", rms_norm_eps=1e-5,
               rope_theta=500000.0, attention_bias=False, mlp_bias=False,
               initializer_range=0.02, bos_token_id=128000, eos_token_id=128001)


def _llama3_rope(factor: float) -> dict:
    return dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)


def _qwen25(**sizes) -> dict:
    return dict(model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0,
                use_sliding_window=False, initializer_range=0.02, bos_token_id=151643,
                eos_token_id=151643, **sizes)


def _qwen3(**sizes) -> dict:
    return dict(model_type="qwen3", vocab_size=151936, head_dim=128, hidden_act="silu", rms_norm_eps=1e-6,
                rope_theta=1000000.0, max_position_embeddings=40960, attention_bias=False,
                use_sliding_window=False, initializer_range=0.02, bos_token_id=151643,
                eos_token_id=151645, **sizes)


def _gemma3(**sizes) -> dict:
    """Gemma 3's text decoder: five local layers (sliding window, rope base 10,000) to one global
    (rope base 1,000,000, linearly scaled 8x from 4B up)."""
    return dict(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                sliding_window_pattern=6, rope_local_base_freq=10000.0, rope_theta=1000000.0,
                attention_bias=False, tie_word_embeddings=True, initializer_range=0.02,
                bos_token_id=2, eos_token_id=1, pad_token_id=0, **sizes)


_GEMMA3_LONG = dict(vocab_size=262208, max_position_embeddings=131072, sliding_window=1024,
                    rope_scaling={"rope_type": "linear", "factor": 8.0})


def _smollm2(**token_ids) -> dict:
    return dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                max_position_embeddings=8192, hidden_act="silu", rms_norm_eps=1e-5,
                rope_theta=100000.0, attention_bias=False, mlp_bias=False,
                tie_word_embeddings=True, initializer_range=0.041666666666666664, **token_ids)


HUB_CONFIGS: dict[str, dict] = {
    "google/gemma-2b": _gemma(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                              num_attention_heads=8, num_key_value_heads=1),
    "google/gemma-7b": _gemma(hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=16),
    "google/gemma-2-2b": _gemma2(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                 query_pre_attn_scalar=256),
    "google/gemma-2-9b": _gemma2(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                 query_pre_attn_scalar=256),
    "google/gemma-2-27b": _gemma2(hidden_size=4608, intermediate_size=36864,
                                  num_hidden_layers=46, num_attention_heads=32,
                                  num_key_value_heads=16, head_dim=128,
                                  query_pre_attn_scalar=144),
    "meta-llama/Llama-3.2-1B": dict(
        _LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_scaling=_llama3_rope(32.0),
        tie_word_embeddings=True),
    "meta-llama/Llama-3.2-3B": dict(
        _LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_scaling=_llama3_rope(32.0),
        tie_word_embeddings=True),
    "meta-llama/Meta-Llama-3-8B": dict(
        _LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_scaling=None, tie_word_embeddings=False),
    "meta-llama/Llama-3.1-8B": dict(
        _LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_scaling=_llama3_rope(8.0), tie_word_embeddings=False),
    "Qwen/Qwen2.5-0.5B": _qwen25(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                 num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2, max_position_embeddings=32768,
                                 tie_word_embeddings=True),
    "Qwen/Qwen2.5-1.5B": _qwen25(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                 num_hidden_layers=28, num_attention_heads=12,
                                 num_key_value_heads=2, max_position_embeddings=131072,
                                 tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B": _qwen25(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                               num_hidden_layers=28, num_attention_heads=28,
                               num_key_value_heads=4, max_position_embeddings=131072,
                               tie_word_embeddings=False),
    "Qwen/Qwen3-0.6B": _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": _qwen3(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen/Qwen3-4B": _qwen3(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": _qwen3(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen/Qwen3-14B": _qwen3(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                             num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen/Qwen3-32B": _qwen3(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                             num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "google/gemma-3-270m": _gemma3(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                                   num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                                   head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                                   max_position_embeddings=32768),
    "google/gemma-3-1b-pt": _gemma3(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                    num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                    head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                                    max_position_embeddings=32768),
    "google/gemma-3-4b-pt": _gemma3(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                    query_pre_attn_scalar=256, **_GEMMA3_LONG),
    "google/gemma-3-12b-pt": _gemma3(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                                     num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                     query_pre_attn_scalar=256, **_GEMMA3_LONG),
    "google/gemma-3-27b-pt": _gemma3(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                                     num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                                     query_pre_attn_scalar=168, **_GEMMA3_LONG),
    "HuggingFaceTB/SmolLM2-135M": _smollm2(bos_token_id=0, eos_token_id=0),
    "HuggingFaceTB/SmolLM2-135M-Instruct": _smollm2(bos_token_id=1, eos_token_id=2,
                                                    pad_token_id=2),
    "gpt2": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12,
                 n_positions=1024, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                 tie_word_embeddings=True, initializer_range=0.02, bos_token_id=50256,
                 eos_token_id=50256),
}


def hf_config(path: str, *, cache_dir: str | None = None) -> tuple[dict, str]:
    """(config.json dict, where it came from) of `config.model.path`, without network access.

    In order: `<path>/config.json` of a local directory; for a hub name ("org/name" or a bare
    name like "gpt2"), the hub cache's config.json (`cache_dir`, default the `HF_HUB_CACHE` of
    `huggingface_hub`), then `HUB_CONFIGS`.

    Raises:
      FileNotFoundError: a local directory without config.json, or a hub name that is neither
        cached nor in the table (the message lists the names the table knows).
    """
    local = pathlib.Path(path).expanduser()
    if local.is_dir():
        file = local / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"config.model.path={path!r}: the directory has no "
                                    "config.json")
        return _text_decoder_config(json.loads(file.read_text())), str(file)
    if os.path.exists(path) or str(path).endswith(".gguf"):
        raise FileNotFoundError(f"config.model.path={path!r}: not an HF directory (GGUF files "
                                "are read by marl_jax.models.loading.read_gguf)")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(str(path), "config.json", cache_dir=cache_dir)
    if isinstance(cached, str):
        return _text_decoder_config(json.loads(pathlib.Path(cached).read_text())), cached
    if path in HUB_CONFIGS:
        return dict(HUB_CONFIGS[path]), f"marl_jax.models.architectures.HUB_CONFIGS[{path!r}]"
    raise FileNotFoundError(
        f"config.model.path={path!r}: no local directory, no config.json in the hub cache, and "
        f"not a known architecture; known: {', '.join(sorted(HUB_CONFIGS))} (or pass a local HF "
        "directory)")


def _text_decoder_config(config: dict) -> dict:
    from marl_jax.models.loading import text_decoder

    return text_decoder(config, {})[0]
