"""`ModelConfig`: every architectural choice of the decoder as a field, read from and written to
Hugging Face `config.json` dictionaries.

The supported families (GPT-2, Llama, Gemma, Gemma-2, Gemma 3, Qwen2, Qwen3, Mistral, OLMo-2,
Phi-3) are one decoder with different field values: norm type, gated or plain MLP, activation,
learned or rotary positions, biases, tied embeddings, embedding scaling, norms before and / or after
attention and MLP, query/key norms, logit soft-capping, sliding-window layers with their own rope
base. SmolLM2 and Llama 3.2 are Llamas; Phi-3's fused projections are split by the key map.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np

FAMILIES = ("gpt2", "llama", "gemma", "qwen2", "gemma2", "qwen3", "gemma3_text", "mistral", "olmo2", "phi3")
NORM_TYPES = ("rmsnorm", "layernorm")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
POSITION_EMBEDDINGS = ("rope", "learned")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# None: no query/key norm; "head": RMSNorm over each head's H values (Qwen3, Gemma 3); "projection":
# over the whole projection N * H (OLMo-2).
QK_NORMS = (None, "head", "projection")
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = ("float32", "bfloat16", "float16")
# Rematerialisation of each decoder layer in the backward pass (MaxText's policies): none keeps
# every activation; full keeps only the layer's input (jax.checkpoint_policies.nothing_saveable);
# dots keeps the outputs of its matmuls (checkpoint_dots); dots_no_batch those of its matmuls
# without batch dimensions, the projections but not the attention einsums
# (checkpoint_dots_with_no_batch_dims).
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_IMPLEMENTATIONS = ("auto", "reference", "xla", "cudnn", "splash")
# The layout the sampler decodes with (`marl_jax.models.decode_layout`).
SAMPLER_LAYOUTS = ("auto", "train", "unrolled", "fused")
# JAX's names for the precision of every dot and einsum: default (TF32 on NVIDIA GPUs for
# float32, one bfloat16 pass on TPUs), high (bfloat16_3x on TPUs), highest (true float32).
MATMUL_PRECISIONS = ("default", "high", "highest")

# transformers activation names -> ours ("gelu_new" and "gelu_pytorch_tanh" are the same tanh
# approximation).
_HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
_TO_HF_ACTIVATION = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}

CAUSAL_LM_ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "gemma": "GemmaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
SEQUENCE_CLASSIFICATION_ARCHITECTURES = {
    "gpt2": "GPT2ForSequenceClassification",
    "llama": "LlamaForSequenceClassification",
    "gemma": "GemmaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "gemma2": "Gemma2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "gemma3_text": "Gemma3TextForSequenceClassification",
    "mistral": "MistralForSequenceClassification",
    "olmo2": "Olmo2ForSequenceClassification",
    "phi3": "Phi3ForSequenceClassification",
}


def _dtype_name(value: Any, field: str) -> str:
    try:
        name = jnp.dtype(value).name
    except TypeError as error:
        raise ValueError(f"ModelConfig.{field}: {value!r} is not a dtype; use one of {DTYPES}") from error
    if name not in DTYPES:
        raise ValueError(f"ModelConfig.{field}: {name!r} is not supported; use one of {DTYPES}")
    return name


def _freeze(mapping: dict | None) -> tuple[tuple[str, Any], ...] | None:
    if mapping is None:
        return None
    return tuple(sorted((str(k), v) for k, v in mapping.items()))


def _as_tuple_of_ints(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture, numerics and token ids of a decoder-only transformer.

    Sizes: `vocab_size` V, `hidden_size` D, `intermediate_size` F, `num_layers`, `num_heads` N,
    `num_kv_heads` K (N % K == 0; K < N is grouped-query attention), `head_dim` H (explicit, as
    Gemma's differs from D / N), `max_position_embeddings`.
    `rope_scaling` is a sorted tuple of (key, value) pairs so the config stays hashable; read it
    as a dict with `rope_scaling_dict`.
    `dtype` is the compute dtype, `param_dtype` the storage dtype; logits are always float32.
    `remat` is the layers' rematerialisation policy (`REMAT_POLICIES`; True means full, False
    none); `scan_layers` runs the layers as one `scan` over parameters stacked on a leading
    "layers" axis (compile time flat in `num_layers`; params `backbone/layers/...` instead of
    `backbone/layers_{i}/...`, KV cache stacked too). Neither changes the numbers.
    `attention` picks the implementation of whole-sequence attention (`marl_jax.models.attention`);
    `matmul_precision` the precision of every dot (None: highest in float32, default otherwise;
    `precision` resolves it). `sampler_layout` is the layout the sampler decodes with
    (`marl_jax.models.decode_layout`); `fused_projections` says that this model's params hold
    q / k / v as one `qkv` and gate / up as one `gate_up` projection (the fused layout builds it).
    Direct construction defaults to Llama-style fields; `for_family` fills in a family's defaults
    and `from_hf` reads a transformers config.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_type: str = "rmsnorm"
    norm_eps: float = 1e-6
    # Gemma stores RMSNorm weights as offsets from one: scale = 1 + w.
    norm_scale_offset: float = 0.0
    # RMSNorm times its weight in float32, cast once (OLMo-2, as Gemma's 1 + w always is); else
    # cast to the compute dtype, then times the weight there (Llama).
    norm_scale_in_float32: bool = False
    activation: str = "silu"
    gated_mlp: bool = True
    position_embedding: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    # Gemma multiplies the token embeddings by sqrt(D).
    scale_embeddings: bool = False
    # Norms before attention and MLP (`pre_norms`) and / or after them, before the residual add
    # (`sandwich_norms`): Llama pre only, Gemma-2 / Gemma 3 both, OLMo-2 after only.
    pre_norms: bool = True
    sandwich_norms: bool = False
    qk_norm: str | None = None
    # Gemma-2 / Gemma 3: attention scale query_pre_attn_scalar ** -0.5 instead of H ** -0.5, tanh
    # soft-capping of attention and final logits. Layers listed in `sliding_layers` attend to the
    # last `sliding_window` positions only (Gemma-2/3, Mistral, Phi-3, Qwen3 when enabled) and,
    # when `local_rope_theta` is set (Gemma 3), rotate with that base and no rope scaling.
    query_pre_attn_scalar: int | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    scan_layers: bool = False
    # Layers per iteration of the layer scan (`jax.lax.scan`'s unroll): fewer loop iterations
    # (each a round trip of the loop's predicate on GPUs) for a longer compile.
    scan_unroll: int = 1
    attention: str = "auto"
    matmul_precision: str | None = None
    sampler_layout: str = "auto"
    fused_projections: bool = False
    # LoRA (`marl_jax.models.lora`): rank 0 = off; adapters on the projections named in
    # `lora_targets`, scaled by lora_alpha / lora_rank. Not part of the HF config.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self):
        object.__setattr__(self, "dtype", _dtype_name(self.dtype, "dtype"))
        object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype, "param_dtype"))
        object.__setattr__(self, "eos_token_id", _as_tuple_of_ints(self.eos_token_id))
        object.__setattr__(self, "sliding_layers", _as_tuple_of_ints(self.sliding_layers))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", _freeze(self.rope_scaling))
        if isinstance(self.remat, (bool, np.bool_)):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat: {self.remat!r} is not one of {REMAT_POLICIES} "
                             "(True means full, False none)")
        if not isinstance(self.scan_unroll, int) or not 1 <= self.scan_unroll <= self.num_layers:
            raise ValueError(f"ModelConfig.scan_unroll must be an int in [1, num_layers={self.num_layers}], "
                             f"got {self.scan_unroll!r}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"ModelConfig.attention: {self.attention!r} is not one of "
                             f"{ATTENTION_IMPLEMENTATIONS}")
        if self.matmul_precision not in (None, *MATMUL_PRECISIONS):
            raise ValueError(f"ModelConfig.matmul_precision: {self.matmul_precision!r} is not one of "
                             f"{MATMUL_PRECISIONS} (or None: highest in float32, default otherwise)")
        if self.sampler_layout not in SAMPLER_LAYOUTS:
            raise ValueError(f"ModelConfig.sampler_layout: {self.sampler_layout!r} is not one of {SAMPLER_LAYOUTS}")
        if self.lora_rank and (self.sampler_layout == "fused" or self.fused_projections):
            raise ValueError("ModelConfig.sampler_layout: fused projections take no LoRA adapters (they run beside "
                             "separate q / k / v / gate / up projections); with lora_rank > 0 use sampler_layout="
                             "unrolled, train or auto")
        if self.fused_projections and self.scan_layers:
            raise ValueError("ModelConfig.fused_projections is a decoding layout of unrolled layers "
                             "(scan_layers=False)")
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family: {self.family!r} is not supported; supported families: {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"ModelConfig.qk_norm: {self.qk_norm!r} is not one of {QK_NORMS}")
        if not (self.pre_norms or self.sandwich_norms):
            raise ValueError("ModelConfig: pre_norms and sandwich_norms are both off; a layer needs one")
        if self.norm_type not in NORM_TYPES:
            raise ValueError(f"ModelConfig.norm_type: {self.norm_type!r} is not one of {NORM_TYPES}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation: {self.activation!r} is not one of {ACTIVATIONS}")
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"ModelConfig.position_embedding: {self.position_embedding!r} is not one of {POSITION_EMBEDDINGS}")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"ModelConfig.rope_scaling: rope_type {rope_type!r} is not one of {ROPE_TYPES}")
        if rope_type != "default" and "factor" not in self.rope_scaling_dict:
            raise ValueError(f"ModelConfig.rope_scaling: rope_type {rope_type!r} needs a 'factor'")
        if rope_type == "yarn" and "original_max_position_embeddings" not in self.rope_scaling_dict:
            raise ValueError("ModelConfig.rope_scaling: rope_type 'yarn' needs "
                             "'original_max_position_embeddings'")
        if self.sliding_layers:
            if not self.sliding_window or self.sliding_window < 1:
                raise ValueError(f"ModelConfig.sliding_window must be a positive int when sliding_layers are set, "
                                 f"got {self.sliding_window!r}")
            bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"ModelConfig.sliding_layers {bad} are not layer indices [0, {self.num_layers})")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive or None, got {value!r}")
        for token_id in (self.bos_token_id, self.pad_token_id, *self.eos_token_id):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"ModelConfig: token id {token_id} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def precision(self) -> str:
        """The precision of every dot: `matmul_precision`, or highest when computing in float32
        and default otherwise."""
        if self.matmul_precision is not None:
            return self.matmul_precision
        return "highest" if self.dtype == "float32" else "default"

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # Construction ------------------------------------------------------------------------------

    @classmethod
    def for_family(cls, family: str, **fields) -> ModelConfig:
        """A config with the architectural defaults of `family` and the given sizes/fields.

        Example (a tiny Llama for tests): `ModelConfig.for_family("llama", vocab_size=128,
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=256)`.
        """
        if family not in FAMILIES:
            raise ValueError(f"family {family!r} is not supported; supported families: {FAMILIES}")
        defaults = {
            "gpt2": dict(norm_type="layernorm", norm_eps=1e-5, activation="gelu_tanh", gated_mlp=False,
                         position_embedding="learned", qkv_bias=True, out_bias=True, mlp_bias=True,
                         tie_word_embeddings=True),
            "llama": dict(norm_type="rmsnorm", norm_eps=1e-6, activation="silu"),
            "gemma": dict(norm_type="rmsnorm", norm_eps=1e-6, norm_scale_offset=1.0, activation="gelu_tanh",
                          tie_word_embeddings=True, scale_embeddings=True),
            "qwen2": dict(norm_type="rmsnorm", norm_eps=1e-6, activation="silu", qkv_bias=True),
            "gemma2": dict(norm_type="rmsnorm", norm_eps=1e-6, norm_scale_offset=1.0, activation="gelu_tanh",
                           tie_word_embeddings=True, scale_embeddings=True, sandwich_norms=True),
            "qwen3": dict(norm_type="rmsnorm", norm_eps=1e-6, activation="silu", qk_norm="head"),
            "gemma3_text": dict(norm_type="rmsnorm", norm_eps=1e-6, norm_scale_offset=1.0, activation="gelu_tanh",
                                tie_word_embeddings=True, scale_embeddings=True, sandwich_norms=True,
                                qk_norm="head"),
            "mistral": dict(norm_type="rmsnorm", norm_eps=1e-6, activation="silu"),
            "olmo2": dict(norm_type="rmsnorm", norm_eps=1e-6, norm_scale_in_float32=True,
                          activation="silu", pre_norms=False, sandwich_norms=True,
                          qk_norm="projection"),
            "phi3": dict(norm_type="rmsnorm", norm_eps=1e-5, activation="silu"),
        }[family]
        return cls(family=family, **{**defaults, **fields})

    @classmethod
    def from_hf(cls, config: dict[str, Any], **overrides) -> ModelConfig:
        """Reads a transformers `config.json` dictionary (legacy `rope_theta`/`rope_scaling` keys or
        transformers-5 `rope_parameters`). `overrides` replace fields (e.g. dtype, remat,
        scan_layers). Token ids outside the vocabulary (some published configs carry e.g.
        `pad_token_id=-1`) are left unset with a warning, as transformers loads them."""
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; supported families: {FAMILIES}")
        reader = _gpt2_from_hf if model_type == "gpt2" else _llama_like_from_hf
        fields = reader(config)
        fields.update(
            _token_ids_in_vocabulary(config, fields["vocab_size"]),
            initializer_range=float(config.get("initializer_range", 0.02)),
        )
        fields.update(overrides)
        return cls.for_family(model_type, **fields)

    def to_hf(self) -> dict[str, Any]:
        """A transformers `config.json` dictionary for the causal-LM architecture of this family."""
        eos = list(self.eos_token_id)
        common = {
            "model_type": self.family,
            "architectures": [CAUSAL_LM_ARCHITECTURES[self.family]],
            "vocab_size": self.vocab_size,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": self.param_dtype,
            "torch_dtype": self.param_dtype,  # the key older transformers and serving tools read
        }
        if self.family == "gpt2":
            return {
                **common,
                "n_embd": self.hidden_size,
                "n_inner": self.intermediate_size,
                "n_layer": self.num_layers,
                "n_head": self.num_heads,
                "n_positions": self.max_position_embeddings,
                "layer_norm_epsilon": self.norm_eps,
                "activation_function": "gelu_new" if self.activation == "gelu_tanh" else self.activation,
            }
        rope = {"rope_type": "default", **self.rope_scaling_dict}
        config = {
            **common,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_eps,
            "hidden_act": _TO_HF_ACTIVATION[self.activation],
            "rope_theta": self.rope_theta,
            "rope_scaling": rope if rope["rope_type"] != "default" else None,
            "rope_parameters": {**rope, "rope_theta": self.rope_theta},
        }
        layer_types = ["sliding_attention" if i in self.sliding_layers else "full_attention"
                       for i in range(self.num_layers)]
        window = self.sliding_window if self.sliding_layers else None
        if self.family == "llama":
            config.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        if self.family in ("qwen3", "olmo2"):
            config["attention_bias"] = self.qkv_bias
        if self.family in ("gemma", "gemma2", "gemma3_text"):
            config["hidden_activation"] = config["hidden_act"]
        if self.family in ("gemma2", "gemma3_text"):
            config.update(
                query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
                attn_logit_softcapping=self.attn_logit_softcap,
                final_logit_softcapping=self.final_logit_softcap,
                sliding_window=self.sliding_window,
                layer_types=layer_types,
            )
        if self.family == "gemma3_text":
            local = {"rope_type": "default", "rope_theta": self.local_rope_theta or self.rope_theta}
            del config["rope_theta"], config["rope_scaling"]
            config["rope_parameters"] = {"full_attention": config["rope_parameters"], "sliding_attention": local}
        if self.family == "qwen3":
            config.update(use_sliding_window=bool(self.sliding_layers), sliding_window=window,
                          layer_types=layer_types, max_window_layers=self.num_layers)
        if self.family in ("mistral", "phi3"):
            config["sliding_window"] = window
        return config


def _token_ids_in_vocabulary(config: dict, vocab_size: int) -> dict[str, Any]:
    """bos / eos / pad ids of a config.json; an id outside [0, vocab_size) is dropped with a
    warning naming it (the model has no such token to emit or to pad with)."""

    def inside(key: str, token_id: int, unset: str) -> bool:
        if 0 <= token_id < vocab_size:
            return True
        warnings.warn(f"config.json {key}={token_id} lies outside the vocabulary [0, {vocab_size}); "
                      f"{unset}", stacklevel=4)
        return False

    ids = {}
    for key in ("bos_token_id", "pad_token_id"):
        value = config.get(key)
        ids[key] = value if value is None or inside(key, int(value), f"{key} is left unset") else None
    ids["eos_token_id"] = tuple(i for i in _as_tuple_of_ints(config.get("eos_token_id"))
                                if inside("eos_token_id", i, f"{i} is dropped from eos_token_id"))
    return ids


def _reject(config: dict, key: str, bad: Any, why: str) -> None:
    if config.get(key, None) == bad:
        raise ValueError(f"config.json {key}={bad!r} is not supported: {why}")


def _gpt2_from_hf(config: dict) -> dict:
    _reject(config, "scale_attn_by_inverse_layer_idx", True, "layer-indexed attention scaling")
    _reject(config, "scale_attn_weights", False, "unscaled attention logits")
    _reject(config, "add_cross_attention", True, "cross-attention (decoder-only models only)")
    hidden = int(config["n_embd"])
    activation = config.get("activation_function", "gelu_new")
    if activation not in _HF_ACTIVATIONS:
        raise ValueError(f"config.json activation_function {activation!r} is not one of {sorted(_HF_ACTIVATIONS)}")
    return dict(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config.get("n_inner") or 4 * hidden),
        num_layers=int(config["n_layer"]),
        num_heads=int(config["n_head"]),
        num_kv_heads=int(config["n_head"]),
        head_dim=hidden // int(config["n_head"]),
        max_position_embeddings=int(config.get("n_positions", 1024)),
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        activation=_HF_ACTIVATIONS[activation],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
    )


def _rope_from_hf(config: dict) -> tuple[float, dict | None]:
    parameters = dict(config.get("rope_parameters") or {})
    if set(parameters) & set(LAYER_TYPES):
        raise ValueError(f"config.json rope_parameters keyed by layer type {sorted(parameters)} are read "
                         "for gemma3_text only")
    factor = parameters.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor is not None and float(factor) != 1.0:
        raise ValueError(f"config.json partial_rotary_factor={factor} is not supported: rotary embeddings "
                         "cover the whole head (1.0)")
    parameters.pop("partial_rotary_factor", None)
    legacy = dict(config.get("rope_scaling") or {})
    if "type" in legacy and "rope_type" not in legacy:
        legacy["rope_type"] = legacy.pop("type")
    merged = {**legacy, **parameters}
    theta = float(merged.pop("rope_theta", config.get("rope_theta", 10000.0)))
    merged.pop("type", None)
    rope_type = merged.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json rope type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    keep = {"linear": ("rope_type", "factor"),
            "llama3": ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"),
            "yarn": ("rope_type", "factor", "original_max_position_embeddings")}[rope_type]
    missing = [k for k in keep if k not in merged]
    if missing:
        raise ValueError(f"config.json rope scaling {rope_type!r} misses {missing}")
    optional = _YARN_OPTIONAL if rope_type == "yarn" else ()
    return theta, {k: merged[k] for k in keep + optional if merged.get(k) is not None}


# YaRN settings with transformers' defaults when absent (beta_fast 32, beta_slow 1, truncate True,
# attention factor from `factor`, or from mscale / mscale_all_dim when both are given).
_YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                  "truncate")


def _gemma3_rope_from_hf(config: dict) -> tuple[float, dict | None, float]:
    """(full-attention theta, its scaling, sliding-attention theta) of a Gemma 3 config: per layer
    type `rope_parameters` (transformers 5) or legacy `rope_theta` / `rope_scaling` /
    `rope_local_base_freq`."""
    parameters = config.get("rope_parameters") or {}
    if set(parameters) & set(LAYER_TYPES):
        unknown = sorted(set(parameters) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"config.json rope_parameters has layer types {unknown}; supported: {LAYER_TYPES}")
        full = {"rope_parameters": parameters.get("full_attention") or {}}
        local = dict(parameters.get("sliding_attention") or {})
    else:
        full = {key: config[key] for key in ("rope_parameters", "rope_scaling", "rope_theta") if key in config}
        local = {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    if "rope_parameters" in full:
        full["rope_parameters"] = {"rope_theta": full.pop("rope_theta"), **full["rope_parameters"]}
    local_type = local.get("rope_type", "default")
    if local_type != "default":
        raise ValueError(f"config.json sliding_attention rope type {local_type!r} is not supported; "
                         "supported: ('default',)")
    theta, scaling = _rope_from_hf(full)
    return theta, scaling, float(local.get("rope_theta", 10000.0))


def _layer_types(config: dict, layers: int) -> list[str]:
    """Per-layer attention kinds from `layer_types`, else from the family's pattern."""
    family = config["model_type"]
    layer_types = config.get("layer_types")
    if layer_types is None:
        if family == "gemma2":
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        elif family == "gemma3_text":
            pattern = config.get("sliding_window_pattern", 6)
            if not isinstance(pattern, int) or pattern < 1:
                raise ValueError(f"config.json sliding_window_pattern={pattern!r} is not supported: "
                                 "a positive int (every pattern-th layer is global)")
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        elif family == "qwen3":
            first = int(config.get("max_window_layers", layers))
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(layer_types) != layers:
        raise ValueError(f"config.json layer_types has {len(layer_types)} entries for num_hidden_layers={layers}; "
                         "one per layer is supported")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"config.json layer_types {unknown} are not supported; supported: {LAYER_TYPES}")
    return layer_types


def _sliding_from_hf(config: dict, layers: int) -> dict:
    """sliding_window and sliding_layers of a config: none unless the family uses windows and the
    config sets one (Qwen3 only with `use_sliding_window`)."""
    family = config["model_type"]
    window = config.get("sliding_window")
    if family == "qwen3" and not config.get("use_sliding_window", False):
        window = None
    if family not in ("gemma2", "gemma3_text", "qwen3", "mistral", "phi3") or not window:
        return dict(sliding_window=None, sliding_layers=())
    # Mistral and Phi-3 window every layer (their models ignore a `layer_types` entry).
    layer_types = ["sliding_attention"] * layers if family in ("mistral", "phi3") else _layer_types(config, layers)
    return dict(sliding_window=int(window),
                sliding_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention"))


def _llama_like_from_hf(config: dict) -> dict:
    family = config["model_type"]
    if family == "qwen2":
        _reject(config, "use_sliding_window", True, "sliding-window attention")
    if family == "gemma3_text":
        _reject(config, "use_bidirectional_attention", True, "bidirectional attention (causal decoders only)")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if family in ("gemma", "gemma2", "gemma3_text") and config.get("hidden_activation") is None:
        # Gemma checkpoints saying hidden_act="gelu" were trained with the tanh approximation.
        activation = "gelu_pytorch_tanh"
    if activation not in _HF_ACTIVATIONS:
        raise ValueError(f"config.json hidden_act {activation!r} is not one of {sorted(_HF_ACTIVATIONS)}")
    local_theta = None
    if family == "gemma3_text":
        theta, scaling, local_theta = _gemma3_rope_from_hf(config)
    else:
        theta, scaling = _rope_from_hf(config)
    fields = dict(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        activation=_HF_ACTIVATIONS[activation],
        rope_theta=theta,
        rope_scaling=_freeze(scaling),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", family in ("gemma", "gemma2", "gemma3_text"))),
        **_sliding_from_hf(config, int(config["num_hidden_layers"])),
    )
    if family in ("llama", "qwen3", "olmo2"):
        bias = bool(config.get("attention_bias", False))
        fields.update(qkv_bias=bias, out_bias=bias)
    if family == "llama":
        fields.update(mlp_bias=bool(config.get("mlp_bias", False)))
    if family in ("gemma2", "gemma3_text"):
        fields.update(
            query_pre_attn_scalar=int(config.get("query_pre_attn_scalar") or fields["head_dim"]),
            attn_logit_softcap=config.get("attn_logit_softcapping"),
            final_logit_softcap=config.get("final_logit_softcapping"),
        )
    if family == "gemma3_text":
        fields["local_rope_theta"] = local_theta
        if fields["attn_logit_softcap"] is not None:
            # Gemma 3 replaced attention soft-capping by q/k norms; transformers' Gemma 3 keeps the
            # config field but never applies it, and so the checkpoint was trained without it.
            warnings.warn(f"config.json attn_logit_softcapping={fields['attn_logit_softcap']} is ignored for "
                          "gemma3_text, as transformers' Gemma 3 ignores it", stacklevel=3)
            fields["attn_logit_softcap"] = None
    return fields


def rope_inverse_frequencies(config: ModelConfig):
    """Inverse frequencies `[H / 2]` (float32) with the config's rope scaling, as transformers
    computes them (so logits match to float32 rounding)."""
    import numpy as np

    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    scaling = config.rope_scaling_dict
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    elif rope_type == "yarn":
        inv_freq = _yarn_inverse_frequencies(inv_freq, dim, config.rope_theta, scaling)
    return inv_freq


def local_rope_inverse_frequencies(config: ModelConfig):
    """Inverse frequencies `[H / 2]` of the sliding-window layers of a config with
    `local_rope_theta` (Gemma 3): the default rope at that base."""
    return rope_inverse_frequencies(config.replace(rope_theta=config.local_rope_theta, rope_scaling=None))


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor YaRN applies to cos and sin (1 for every other rope type)."""
    scaling = config.rope_scaling_dict
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale):
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


def _yarn_inverse_frequencies(inv_freq, dim, theta, scaling):
    """YaRN (Peng et al., 2023): interpolated frequencies below a ramp over the dimensions whose
    wavelengths fall between `beta_fast` and `beta_slow` rotations of the original context,
    extrapolated (unchanged) above it."""
    import numpy as np

    factor = float(scaling["factor"])
    context = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    interpolated = (inv_freq / np.float32(factor)).astype(np.float32)
    return (interpolated * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)
