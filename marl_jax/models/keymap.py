"""Hugging Face tensor names <-> our parameter paths, one rule per HF tensor.

A rule names one HF tensor, the parameter paths it fills, and the two layout conversions
(HF -> params, params -> HF). Fused tensors (GPT-2's `c_attn`, Phi-3's `qkv_proj` and
`gate_up_proj`) are rules that fill several paths: the decoder keeps separate q, k, v, gate, up.
HF layouts: `nn.Linear.weight [out, in]` (Llama, Gemma, Qwen2) and `Conv1D.weight [in, out]`
(GPT-2). Ours: `[in..., out...]` kernels with heads split out, e.g. q `[D, N, H]`, o `[N, H, D]`.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from marl_jax.models.config import ModelConfig

Path = tuple[str, ...]

# Buffers some checkpoints carry that are not parameters.
_IGNORED_GPT2 = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(masked_)?bias$")
_IGNORED_ROTARY = re.compile(r"^(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
LM_HEAD = "lm_head.weight"
SCORE = "score.weight"


@dataclasses.dataclass(frozen=True)
class Rule:
    hf_name: str
    paths: tuple[Path, ...]
    to_params: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[..., np.ndarray]


def _same(hf_name: str, path: Path) -> Rule:
    return Rule(hf_name, (path,), lambda w: (w,), lambda p: p)


def _transposed(hf_name: str, path: Path) -> Rule:
    return Rule(hf_name, (path,), lambda w: (w.T,), lambda p: p.T)


def _reshaped(hf_name: str, path: Path, shape: tuple[int, ...]) -> Rule:
    hf_shape = (int(np.prod(shape)),)
    return Rule(hf_name, (path,), lambda w: (w.reshape(shape),), lambda p: p.reshape(hf_shape))


def _linear_in(hf_name: str, path: Path, out_shape: tuple[int, ...]) -> Rule:
    """nn.Linear `[prod(out), D]` -> kernel `[D, *out]`."""
    return Rule(hf_name, (path,), lambda w: (w.T.reshape(w.shape[1], *out_shape),),
                lambda p: p.reshape(p.shape[0], -1).T)


def _linear_out(hf_name: str, path: Path, in_shape: tuple[int, ...]) -> Rule:
    """nn.Linear `[D, prod(in)]` -> kernel `[*in, D]`."""
    return Rule(hf_name, (path,), lambda w: (w.T.reshape(*in_shape, w.shape[0]),),
                lambda p: p.reshape(-1, p.shape[-1]).T)


def body_prefix(family: str) -> str:
    return "transformer." if family == "gpt2" else "model."


def backbone_rules(config: ModelConfig) -> list[Rule]:
    return _gpt2_rules(config) if config.family == "gpt2" else _llama_like_rules(config)


def _llama_like_rules(cfg: ModelConfig) -> list[Rule]:
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rules = [
        _same("model.embed_tokens.weight", ("backbone", "embed", "embedding")),
        _same("model.norm.weight", ("backbone", "final_norm", "scale")),
    ]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", ("backbone", f"layers_{i}")
        if cfg.sandwich_norms:  # Gemma-2/3 and OLMo-2 name their post norms differently
            rules += [
                _same(hf + "post_attention_layernorm.weight", ours + ("post_attn_norm", "scale")),
                _same(hf + "post_feedforward_layernorm.weight", ours + ("post_mlp_norm", "scale")),
            ]
            if cfg.pre_norms:
                rules.append(_same(hf + "pre_feedforward_layernorm.weight", ours + ("mlp_norm", "scale")))
        else:
            rules.append(_same(hf + "post_attention_layernorm.weight", ours + ("mlp_norm", "scale")))
        if cfg.pre_norms:
            rules.append(_same(hf + "input_layernorm.weight", ours + ("attn_norm", "scale")))
        if cfg.qk_norm:
            rules += [_same(hf + f"self_attn.{name}.weight", ours + ("attn", name, "scale"))
                      for name in ("q_norm", "k_norm")]
        rules += _projection_rules(cfg, hf, ours)
        if cfg.qkv_bias:
            rules += [
                _reshaped(hf + "self_attn.q_proj.bias", ours + ("attn", "q", "bias"), (n, h)),
                _reshaped(hf + "self_attn.k_proj.bias", ours + ("attn", "k", "bias"), (k, h)),
                _reshaped(hf + "self_attn.v_proj.bias", ours + ("attn", "v", "bias"), (k, h)),
            ]
        if cfg.out_bias:
            rules.append(_same(hf + "self_attn.o_proj.bias", ours + ("attn", "o", "bias")))
        if cfg.mlp_bias:
            rules += [_same(hf + f"mlp.{name}_proj.bias", ours + ("mlp", name, "bias"))
                      for name in ("gate", "up", "down")]
    return rules


def _projection_rules(cfg: ModelConfig, hf: str, ours: Path) -> list[Rule]:
    """Attention and MLP weights of one layer: separate q/k/v and gate/up tensors, or Phi-3's
    fused `qkv_proj [(N + 2K) H, D]` and `gate_up_proj [2F, D]` (gate first)."""
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    attn, mlp = ours + ("attn",), ours + ("mlp",)
    shared = [
        _linear_out(hf + "self_attn.o_proj.weight", attn + ("o", "kernel"), (n, h)),
        _transposed(hf + "mlp.down_proj.weight", mlp + ("down", "kernel")),
    ]
    if cfg.family == "phi3":
        return shared + [
            Rule(hf + "self_attn.qkv_proj.weight", (attn + ("q", "kernel"), attn + ("k", "kernel"), attn + ("v", "kernel")),
                 lambda w: tuple(part.T.reshape(d, -1, h) for part in np.split(w, [n * h, (n + k) * h])),
                 lambda q, k_, v: np.concatenate([x.reshape(d, -1).T for x in (q, k_, v)])),
            Rule(hf + "mlp.gate_up_proj.weight", (mlp + ("gate", "kernel"), mlp + ("up", "kernel")),
                 lambda w: tuple(part.T for part in np.split(w, 2)),
                 lambda gate, up: np.concatenate([gate.T, up.T])),
        ]
    return shared + [
        _linear_in(hf + "self_attn.q_proj.weight", attn + ("q", "kernel"), (n, h)),
        _linear_in(hf + "self_attn.k_proj.weight", attn + ("k", "kernel"), (k, h)),
        _linear_in(hf + "self_attn.v_proj.weight", attn + ("v", "kernel"), (k, h)),
        _transposed(hf + "mlp.gate_proj.weight", mlp + ("gate", "kernel")),
        _transposed(hf + "mlp.up_proj.weight", mlp + ("up", "kernel")),
    ]


def _gpt2_rules(cfg: ModelConfig) -> list[Rule]:
    n, h, d = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    rules = [
        _same("transformer.wte.weight", ("backbone", "embed", "embedding")),
        _same("transformer.wpe.weight", ("backbone", "position_embedding")),
        _same("transformer.ln_f.weight", ("backbone", "final_norm", "scale")),
        _same("transformer.ln_f.bias", ("backbone", "final_norm", "bias")),
    ]
    for i in range(cfg.num_layers):
        hf, ours = f"transformer.h.{i}.", ("backbone", f"layers_{i}")
        qkv = tuple(ours + ("attn", name) for name in ("q", "k", "v"))
        rules += [
            _same(hf + "ln_1.weight", ours + ("attn_norm", "scale")),
            _same(hf + "ln_1.bias", ours + ("attn_norm", "bias")),
            _same(hf + "ln_2.weight", ours + ("mlp_norm", "scale")),
            _same(hf + "ln_2.bias", ours + ("mlp_norm", "bias")),
            Rule(hf + "attn.c_attn.weight", tuple(p + ("kernel",) for p in qkv),
                 lambda w: tuple(part.reshape(d, n, h) for part in np.split(w, 3, axis=1)),
                 lambda q, k, v: np.concatenate([x.reshape(d, n * h) for x in (q, k, v)], axis=1)),
            Rule(hf + "attn.c_attn.bias", tuple(p + ("bias",) for p in qkv),
                 lambda b: tuple(part.reshape(n, h) for part in np.split(b, 3)),
                 lambda q, k, v: np.concatenate([x.reshape(n * h) for x in (q, k, v)])),
            Rule(hf + "attn.c_proj.weight", (ours + ("attn", "o", "kernel"),),
                 lambda w: (w.reshape(n, h, d),), lambda p: p.reshape(n * h, d)),
            _same(hf + "attn.c_proj.bias", ours + ("attn", "o", "bias")),
            _same(hf + "mlp.c_fc.weight", ours + ("mlp", "up", "kernel")),
            _same(hf + "mlp.c_fc.bias", ours + ("mlp", "up", "bias")),
            _same(hf + "mlp.c_proj.weight", ours + ("mlp", "down", "kernel")),
            _same(hf + "mlp.c_proj.bias", ours + ("mlp", "down", "bias")),
        ]
    return rules


def lm_head_rule() -> Rule:
    return _transposed(LM_HEAD, ("lm_head",))


def score_rule() -> Rule:
    return _transposed(SCORE, ("head", "kernel"))


def canonical_names(family: str, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Adds the body prefix (`model.` / `transformer.`) to the keys of a headless checkpoint
    (e.g. saved from `LlamaModel`), so every checkpoint uses the names of the rules above."""
    prefix = body_prefix(family)
    if any(name.startswith(prefix) for name in state):
        return state
    return {name if name in (LM_HEAD, SCORE) else prefix + name: value for name, value in state.items()}


def is_ignored(family: str, hf_name: str) -> bool:
    return bool((_IGNORED_GPT2 if family == "gpt2" else _IGNORED_ROTARY).match(hf_name))
