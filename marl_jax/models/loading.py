"""Loading pretrained weights without torch: Hugging Face directories (config.json + safetensors,
sharded or not) and GGUF files (llama.cpp; dequantised to float with the `gguf` package).

Both readers produce a transformers-style config dict and a state dict under HF tensor names; one
key map (`keymap.py`) turns that into our parameter tree.
"""
from __future__ import annotations

import functools
import json
import os
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from marl_jax.models import keymap
from marl_jax.models.config import FAMILIES, ModelConfig
from marl_jax.models.heads import CausalLM, ScalarHeadModel, reward_head_init_std
from marl_jax.models.params import stack_layers

HEADS = ("lm", "scalar")
# llama.cpp architecture -> model_type (llama.cpp writes Mistral checkpoints as "llama").
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma": "gemma", "gpt2": "gpt2", "qwen3": "qwen3",
                      "gemma2": "gemma2", "gemma3": "gemma3_text", "olmo2": "olmo2", "phi3": "phi3"}
# llama.cpp's Gemma 3: every sixth layer global, local layers at rope base 10000 (src/llama-model.cpp).
_GGUF_GEMMA3_PATTERN, _GGUF_GEMMA3_LOCAL_THETA = 6, 10000.0


# Hugging Face directories -------------------------------------------------------------------------

def read_hf_directory(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(config dict, state dict) of an HF model directory: `config.json` and `*.safetensors`
    (through `model.safetensors.index.json` when present)."""
    import safetensors.numpy

    directory = pathlib.Path(path)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{directory}: no config.json (expected a Hugging Face model directory or a .gguf file)")
    config = json.loads(config_path.read_text())
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in files if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory}: shards listed in {index.name} are missing: {missing}")
        paths = [directory / name for name in files]
    else:
        paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(
            f"{directory}: no *.safetensors weights (pytorch_model.bin is not read: it needs torch)")
    state: dict[str, np.ndarray] = {}
    for file in paths:
        state.update(safetensors.numpy.load_file(str(file)))
    return config, state


# Image-text checkpoints read as their text decoder: Gemma 3 from 4B up is published only as
# `Gemma3ForConditionalGeneration` (weights under `language_model.model.` or, as transformers 5
# saves them, `model.language_model.`; a vision tower and projector beside them).
_MULTIMODAL_TEXT_TYPES = {"gemma3": "gemma3_text"}
_TEXT_DECODER_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                          ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def text_decoder(config: dict, state: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """(config, state) of the text decoder of an image-text checkpoint with a `text_config`
    (its fields completed with transformers' defaults, as the published configs list only
    those that differ); any other checkpoint unchanged. The vision weights are dropped."""
    text_type = _MULTIMODAL_TEXT_TYPES.get(config.get("model_type"))
    if text_type is None or "text_config" not in config:
        return config, state
    from transformers import AutoConfig

    fields = {k: v for k, v in config["text_config"].items() if k != "model_type"}
    text = AutoConfig.for_model(text_type, **fields).to_dict()
    text["model_type"] = text_type
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None and text.get(key) is None:
            text[key] = config[key]
    renamed = {}
    for name, value in state.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        for old, new in _TEXT_DECODER_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = value
    return text, renamed


# GGUF ---------------------------------------------------------------------------------------------

def _gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_name_map(architecture: str) -> list[tuple[re.Pattern, str]]:
    """llama.cpp tensor names -> HF names."""
    if architecture == "gpt2":
        table = {
            r"token_embd\.weight": "transformer.wte.weight",
            r"position_embd\.weight": "transformer.wpe.weight",
            r"output_norm\.(weight|bias)": r"transformer.ln_f.\1",
            r"output\.weight": keymap.LM_HEAD,
            r"blk\.(\d+)\.attn_norm\.(weight|bias)": r"transformer.h.\1.ln_1.\2",
            r"blk\.(\d+)\.ffn_norm\.(weight|bias)": r"transformer.h.\1.ln_2.\2",
            r"blk\.(\d+)\.attn_qkv\.(weight|bias)": r"transformer.h.\1.attn.c_attn.\2",
            r"blk\.(\d+)\.attn_output\.(weight|bias)": r"transformer.h.\1.attn.c_proj.\2",
            r"blk\.(\d+)\.ffn_up\.(weight|bias)": r"transformer.h.\1.mlp.c_fc.\2",
            r"blk\.(\d+)\.ffn_down\.(weight|bias)": r"transformer.h.\1.mlp.c_proj.\2",
        }
    else:
        table = {
            r"token_embd\.weight": "model.embed_tokens.weight",
            r"output_norm\.weight": "model.norm.weight",
            r"output\.weight": keymap.LM_HEAD,
            r"blk\.(\d+)\.attn_norm\.weight": r"model.layers.\1.input_layernorm.weight",
            r"blk\.(\d+)\.ffn_norm\.weight": r"model.layers.\1.post_attention_layernorm.weight",
            r"blk\.(\d+)\.attn_q\.(weight|bias)": r"model.layers.\1.self_attn.q_proj.\2",
            r"blk\.(\d+)\.attn_k\.(weight|bias)": r"model.layers.\1.self_attn.k_proj.\2",
            r"blk\.(\d+)\.attn_v\.(weight|bias)": r"model.layers.\1.self_attn.v_proj.\2",
            r"blk\.(\d+)\.attn_output\.(weight|bias)": r"model.layers.\1.self_attn.o_proj.\2",
            r"blk\.(\d+)\.ffn_gate\.(weight|bias)": r"model.layers.\1.mlp.gate_proj.\2",
            r"blk\.(\d+)\.ffn_up\.(weight|bias)": r"model.layers.\1.mlp.up_proj.\2",
            r"blk\.(\d+)\.ffn_down\.(weight|bias)": r"model.layers.\1.mlp.down_proj.\2",
            r"blk\.(\d+)\.attn_q_norm\.weight": r"model.layers.\1.self_attn.q_norm.weight",
            r"blk\.(\d+)\.attn_k_norm\.weight": r"model.layers.\1.self_attn.k_norm.weight",
            r"blk\.(\d+)\.post_attention_norm\.weight": r"model.layers.\1.post_attention_layernorm.weight",
            r"blk\.(\d+)\.post_ffw_norm\.weight": r"model.layers.\1.post_feedforward_layernorm.weight",
        }
        if architecture in ("gemma2", "gemma3"):  # llama.cpp's ffn_norm is Gemma's norm before the MLP
            table[r"blk\.(\d+)\.ffn_norm\.weight"] = r"model.layers.\1.pre_feedforward_layernorm.weight"
        if architecture == "phi3":  # fused projections
            table[r"blk\.(\d+)\.attn_qkv\.weight"] = r"model.layers.\1.self_attn.qkv_proj.weight"
            table[r"blk\.(\d+)\.ffn_up\.(weight|bias)"] = r"model.layers.\1.mlp.gate_up_proj.\2"
    return [(re.compile(pattern + "$"), target) for pattern, target in table.items()]


def _unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion of Llama q/k rows from the half-split rotary layout to the
    interleaved one (`convert_hf_to_gguf.py: LlamaModel.permute`)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_config(path: str | os.PathLike) -> dict:
    """The transformers-style config dict of a GGUF file, from its metadata alone (no tensor is
    read: the tensors are memory-mapped and left untouched)."""
    return _gguf_config(gguf_reader(path), path)


@functools.cache
def plain_array_gguf_reader() -> type:
    """`gguf.GGUFReader` over a plain ndarray view of the file's memory map: the same fields and
    tensors (views of the same mapped bytes), its metadata parsed 2.5-3.5x faster. The reader slices
    its data a few times per metadata value, over a million times for a 262k-token vocabulary, and
    every slice of numpy's `memmap` subclass runs two Python methods; a plain view runs none."""
    import gguf

    class PlainArrayGGUFReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain_data = mapped.view(np.ndarray)

    return PlainArrayGGUFReader


def gguf_reader(path: str | os.PathLike):
    """An open GGUF file (`plain_array_gguf_reader`'s reader)."""
    return plain_array_gguf_reader()(str(path))


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(transformers-style config dict, float32 state dict under HF names) of a GGUF file."""
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    config = _gguf_config(reader, path)
    architecture = _gguf_value(reader, "general.architecture")
    heads = config.get("num_attention_heads", config.get("n_head"))
    kv_heads = config.get("num_key_value_heads", heads)
    name_map = _gguf_name_map(architecture)
    state: dict[str, np.ndarray] = {}
    unknown = []
    for tensor in reader.tensors:
        hf_name = next((pattern.sub(target, tensor.name) for pattern, target in name_map
                        if pattern.match(tensor.name)), None)
        if hf_name is None:
            unknown.append(tensor.name)
            continue
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if architecture == "llama" and ".self_attn.q_proj." in hf_name:
            weight = _unpermute_rope_rows(weight, heads)
        elif architecture == "llama" and ".self_attn.k_proj." in hf_name:
            weight = _unpermute_rope_rows(weight, kv_heads)
        elif architecture in ("gemma", "gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            weight = weight - 1.0  # llama.cpp stores Gemma's RMSNorm scale as 1 + w
        elif architecture == "gpt2" and hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            weight = weight.T  # llama.cpp stores GPT-2's Conv1D weights as [out, in]
        state[hf_name] = weight
    if unknown:
        raise ValueError(f"{path}: unexpected GGUF tensors (no mapping): {unknown}")
    return config, state


def _gguf_config(reader, path) -> dict:
    """The transformers-style config dict of an open `gguf.GGUFReader`'s metadata."""
    architecture = _gguf_value(reader, "general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")

    def meta(key, default=None):
        return _gguf_value(reader, f"{architecture}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    vocab_size = meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    hidden = int(meta("embedding_length"))
    tokens = {
        "bos_token_id": _gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _gguf_value(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _gguf_value(reader, "tokenizer.ggml.padding_token_id"),
    }
    if architecture == "gpt2":
        config = dict(
            model_type="gpt2", vocab_size=int(vocab_size), n_embd=hidden, n_head=heads,
            n_layer=int(meta("block_count")), n_inner=int(meta("feed_forward_length")),
            n_positions=int(meta("context_length")),
            layer_norm_epsilon=float(meta("attention.layer_norm_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in tensor_names, **tokens)
    else:
        config = dict(
            model_type=GGUF_ARCHITECTURES[architecture], vocab_size=int(vocab_size), hidden_size=hidden,
            intermediate_size=int(meta("feed_forward_length")), num_hidden_layers=int(meta("block_count")),
            num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=int(meta("attention.key_length", hidden // heads)),
            max_position_embeddings=int(meta("context_length")),
            rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta("rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in tensor_names, **tokens)
        if architecture == "qwen2":
            config["use_sliding_window"] = False
        if architecture in ("gemma2", "gemma3", "phi3") and meta("attention.sliding_window"):
            config["sliding_window"] = int(meta("attention.sliding_window"))
        if architecture in ("gemma2", "gemma3"):
            # llama.cpp scales the queries of the 27B models (Gemma-2: 46 layers, Gemma 3: 62) by
            # hidden / heads, the others' by head_dim.
            big = config["num_hidden_layers"] == {"gemma2": 46, "gemma3": 62}[architecture]
            config["query_pre_attn_scalar"] = hidden // heads if big else config["head_dim"]
        if architecture == "gemma2":
            config.update(attn_logit_softcapping=meta("attn_logit_softcapping"),
                          final_logit_softcapping=meta("final_logit_softcapping"))
        if architecture == "gemma3":
            config.update(sliding_window_pattern=_GGUF_GEMMA3_PATTERN, rope_local_base_freq=_GGUF_GEMMA3_LOCAL_THETA)
        scaling = meta("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise ValueError(f"{path}: GGUF rope scaling {scaling!r} is not supported (only 'linear')")
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    return config


# Param trees --------------------------------------------------------------------------------------

def _abstract_params(model: nn.Module) -> dict:
    ids = jnp.zeros((1, 1), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids))
    return nn.meta.unbox(shapes["params"])


def _summarise(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def params_from_state(model: nn.Module, state: dict[str, np.ndarray], *, head: str,
                      head_key: jax.Array | None = None) -> dict:
    """Our param tree (float arrays of `config.param_dtype`) from an HF-named state dict, stacked
    when `config.scan_layers`. Raises ValueError naming missing, unexpected or mis-shaped weights."""
    cfg = model.config
    if cfg.scan_layers:
        # The key map names per-layer tensors: match and convert unrolled, stack at the end.
        model = model.clone(config=cfg.replace(scan_layers=False))
    state = keymap.canonical_names(cfg.family, state)
    rules = keymap.backbone_rules(cfg)
    ignored = set()
    if head == "lm":
        if cfg.tie_word_embeddings:
            ignored.add(keymap.LM_HEAD)  # tied: transformers ignores a stored copy too
        else:
            rules.append(keymap.lm_head_rule())
        ignored.add(keymap.SCORE)  # a reward model read as a policy keeps its backbone only
    else:
        ignored.add(keymap.LM_HEAD)  # a policy read as a reward model / critic keeps its backbone only
        if keymap.SCORE in state:
            rules.append(keymap.score_rule())
    wanted = {rule.hf_name for rule in rules}
    missing = [rule.hf_name for rule in rules if rule.hf_name not in state]
    unexpected = [name for name in state
                  if name not in wanted and name not in ignored and not keymap.is_ignored(cfg.family, name)]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing weights: {_summarise(missing)}")
        if unexpected:
            parts.append(f"unexpected weights: {_summarise(unexpected)}")
        raise ValueError(f"checkpoint does not match the {cfg.family} config: " + "; ".join(parts))

    flat = {}
    for rule in rules:
        for path, value in zip(rule.paths, rule.to_params(np.asarray(state[rule.hf_name]))):
            flat[path] = value
    expected = traverse_util.flatten_dict(_abstract_params(model))
    if head == "scalar" and ("head", "kernel") not in flat:
        key = jax.random.key(0) if head_key is None else head_key
        flat[("head", "kernel")] = model.head_init_std * jax.random.normal(key, (cfg.hidden_size, 1), jnp.float32)
    bad_shapes = [f"{'/'.join(path)}: checkpoint {tuple(flat[path].shape)} vs model {tuple(leaf.shape)}"
                  for path, leaf in expected.items() if path in flat and tuple(flat[path].shape) != tuple(leaf.shape)]
    if bad_shapes:
        raise ValueError("checkpoint weights have the wrong shape: " + "; ".join(bad_shapes))
    if set(flat) != set(expected):
        raise ValueError(f"parameters not covered by the key map: {sorted(set(expected) - set(flat))}")
    dtype = cfg.weight_dtype
    if not cfg.scan_layers:
        return traverse_util.unflatten_dict({path: jnp.asarray(value, dtype) for path, value in flat.items()})
    # Cast on the host, so the device holds each weight once, in its final dtype and layout.
    unrolled = traverse_util.unflatten_dict({path: np.asarray(value, dtype) for path, value in flat.items()})
    return jax.tree.map(jnp.asarray, stack_layers(unrolled, cfg.num_layers))


def build_model(config: ModelConfig, head: str = "lm", head_init_std: float | None = None) -> nn.Module:
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    if head == "lm":
        return CausalLM(config)
    return ScalarHeadModel(config, reward_head_init_std(config) if head_init_std is None else head_init_std)


def load_pretrained(path: str | os.PathLike, dtype=jnp.float32, *, head: str = "lm", compute_dtype=None,
                    head_init_std: float | None = None, head_key: jax.Array | None = None,
                    remat: bool | str = "none", scan_layers: bool = False, attention: str = "auto",
                    matmul_precision: str | None = None):
    """(model, params) from an HF directory or a `.gguf` file.

    `dtype`: parameter dtype, and the compute dtype unless `compute_dtype` is given.
    `remat`, `scan_layers`, `attention`, `matmul_precision`: the `ModelConfig` fields (None:
    highest precision in float32, default otherwise); with `scan_layers` the params come stacked
    (`backbone/layers/...`, leading axis L).
    `head="lm"`: `CausalLM`; `head="scalar"`: `ScalarHeadModel`, reading `score.weight` of a
    `*ForSequenceClassification` checkpoint when present, else initialising the head with std
    `head_init_std` (default 1/sqrt(D + 1), the reward-model init) from `head_key`.
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    path = pathlib.Path(path)
    if path.is_file() and path.suffix == ".gguf":
        hf_config, state = read_gguf(path)
    elif path.is_dir():
        hf_config, state = text_decoder(*read_hf_directory(path))
    else:
        raise FileNotFoundError(f"{path}: neither a Hugging Face model directory nor a .gguf file")
    if hf_config.get("model_type") not in FAMILIES:
        raise ValueError(f"{path}: model_type {hf_config.get('model_type')!r} is not supported; "
                         f"supported families: {FAMILIES}")
    try:
        config = ModelConfig.from_hf(hf_config, param_dtype=dtype,
                                     dtype=dtype if compute_dtype is None else compute_dtype, remat=remat,
                                     scan_layers=scan_layers, attention=attention,
                                     matmul_precision=matmul_precision)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    model = build_model(config, head, head_init_std)
    return model, params_from_state(model, state, head=head, head_key=head_key)
