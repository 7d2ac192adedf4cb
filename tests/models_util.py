"""Test helpers for the model layer: tiny random transformers checkpoints of every family, written
with transformers' own `save_pretrained`, and reference logits from the torch models."""
from __future__ import annotations

import contextlib
import functools
import random

import numpy as np

VOCAB = 96


def use_one_torch_thread():
    """Reference models run on one torch thread: on a shared 2-core CI machine, torch's spinning
    OpenMP workers slow down by 10x or more whenever another process holds a core. The helpers
    below that build or run torch models call it, so a module that uses only them imports
    without torch (the smoke set's virtualenvs have none)."""
    import torch

    torch.set_num_threads(1)


@contextlib.contextmanager
def transformers_reads_gguf_fast():
    """Within the block transformers opens GGUF files with the loader's plain-array reader
    (`loading.plain_array_gguf_reader`: the `gguf` package's reader, the same fields and tensors,
    test_models checks on SmolLM2's file) instead of the package's memmap one, whose metadata
    parsing takes 10-40 s for a large vocabulary. transformers imports `gguf.GGUFReader` when it
    reads a file, so the reference's conversion, dequantisation and tokenizer are its own."""
    import gguf

    from marl_jax.models.loading import plain_array_gguf_reader

    package_reader = gguf.GGUFReader
    gguf.GGUFReader = plain_array_gguf_reader()
    try:
        yield
    finally:
        gguf.GGUFReader = package_reader


# Small but exercising every architectural branch: GQA / MQA, rope scaling (llama3, linear),
# head_dim != hidden / heads (Gemma), qkv bias (Qwen2), untied LM head, Gemma-2's sandwich norms,
# soft-capping (small caps so that tanh bites) and a sliding window shorter than the test sequences.
CASES = {
    "gpt2": dict(model_type="gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                 pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "llama_gqa_llama3_untied": dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16, "rope_theta": 500.0},
        pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "llama_linear_tied": dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "gemma_mqa_head_dim": dict(
        model_type="gemma", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=10, max_position_embeddings=128,
        pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "gemma2_softcap_window": dict(
        model_type="gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        query_pre_attn_scalar=12, attn_logit_softcapping=2.0, final_logit_softcapping=1.5, sliding_window=4,
        pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "qwen2_yarn": dict(
        model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                         "rope_theta": 1000.0},
        pad_token_id=0, eos_token_id=1, bos_token_id=1),
    # The families of 2025-26: hidden size, heads, kv heads and head_dim all different, sliding
    # windows (4) shorter than the test sequences.
    "qwen3_window_head_dim": dict(
        model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=128,
        tie_word_embeddings=False, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "gemma3_local_global": dict(
        model_type="gemma3_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=128,
        query_pre_attn_scalar=10, sliding_window=4, layer_types=["sliding_attention", "full_attention",
                                                                  "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
        pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "mistral_window_mqa": dict(
        model_type="mistral", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=10, max_position_embeddings=128,
        sliding_window=4, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "olmo2_post_norms": dict(
        model_type="olmo2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "phi3_fused_window": dict(
        model_type="phi3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=128,
        original_max_position_embeddings=128, sliding_window=4, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "qwen2_bias": dict(
        model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=1),
}


def hf_config(case: str, **overrides):
    from transformers import AutoConfig

    fields = dict(CASES[case])
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **{**fields, **overrides})


def random_hf_model(case: str, *, seed: int = 0, head: str = "lm", **overrides):
    """A torch model of `case` (CausalLM or, with head="scalar", SequenceClassification with one
    label) with every parameter randomised, norms and biases included, in eval mode, fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    use_one_torch_thread()
    torch.manual_seed(seed)
    config = hf_config(case, **overrides)
    config._attn_implementation = "eager"
    if head == "scalar":
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval().float()


def write_checkpoint(model, directory, **save_kwargs) -> str:
    model.save_pretrained(directory, **save_kwargs)
    return str(directory)


def padded_batch(lengths: list[int], total: int, *, seed: int, vocab: int = VOCAB, right_pad: list[int] | None = None):
    """ids, mask `[B, total]` int32: row b has `lengths[b]` valid tokens, left-padded, then
    `right_pad[b]` right pads (prompt + response layout). Pad ids are random junk on purpose."""
    rng = np.random.default_rng(seed)
    right_pad = right_pad or [0] * len(lengths)
    ids = rng.integers(3, vocab, size=(len(lengths), total)).astype(np.int32)
    mask = np.zeros((len(lengths), total), np.int32)
    for row, (length, right) in enumerate(zip(lengths, right_pad)):
        mask[row, total - right - length: total - right] = 1
    return ids, mask


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Reference logits of a torch CausalLM with positions cumsum(mask) - 1, float32 numpy."""
    import torch

    use_one_torch_thread()
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                    attention_mask=torch.as_tensor(mask, dtype=torch.long),
                    position_ids=torch.as_tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


@functools.lru_cache(maxsize=1)
def smollm2(path):
    """(our model, our params, transformers model, tokenizer) of the SmolLM2 GGUF at `path`, loaded
    once per test session (both test modules use it)."""
    from transformers import AutoModelForCausalLM

    import marl_jax.models as M

    use_one_torch_thread()
    model, params = M.load_pretrained(path)
    with transformers_reads_gguf_fast():
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  attn_implementation="eager").eval()
    return model, params, hf, M.load_tokenizer(path)


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: q/k rows from the half-split rotary layout to interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


_GGUF_ARCHITECTURES = {"gemma3_text": "gemma3"}
# HF block tensor names -> llama.cpp's, per architecture where they differ from Llama's.
_GGUF_BLOCK_NAMES = {
    "gemma2": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "gemma3": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "olmo2": {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}


def write_gguf(model, path) -> str:
    """Writes a torch CausalLM (llama, qwen2, qwen3, gemma, gemma2, gemma3, olmo2, phi3 or gpt2) as an F32
    GGUF the way llama.cpp's convert_hf_to_gguf.py lays it out (tensor names, Llama q/k
    permutation, Gemma norms stored as 1 + w, GPT-2 weights as [out, in]; Gemma 3's layer
    pattern, local rope base and query scale are llama.cpp's fixed ones, so the model should use
    them), with a placeholder vocabulary so readers can size it."""
    import gguf

    config = model.config
    arch = _GGUF_ARCHITECTURES.get(config.model_type, config.model_type)
    state = {name: tensor.detach().numpy().astype(np.float32) for name, tensor in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), arch)
    if arch == "gpt2":
        writer.add_block_count(config.n_layer)
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        names = {"transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
                 "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias"}
        block = {"ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
                 "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
        for i in range(config.n_layer):
            for hf_part, cpp_part in block.items():
                for kind in ("weight", "bias"):
                    names[f"transformer.h.{i}.{hf_part}.{kind}"] = f"blk.{i}.{cpp_part}.{kind}"
    else:
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        rope = config.rope_parameters.get("full_attention", config.rope_parameters)
        writer.add_rope_freq_base(rope["rope_theta"])
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        if getattr(config, "sliding_window", None) and arch in ("gemma2", "gemma3", "phi3"):
            writer.add_sliding_window(config.sliding_window)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_vocab_size(config.vocab_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
        block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                 **_GGUF_BLOCK_NAMES.get(arch, {})}
        for i in range(config.num_hidden_layers):
            for hf_part, cpp_part in block.items():
                for kind in ("weight", "bias"):
                    names[f"model.layers.{i}.{hf_part}.{kind}"] = f"blk.{i}.{cpp_part}.{kind}"
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    for name, value in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = _llama_cpp_permute(value, config.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            value = _llama_cpp_permute(value, config.num_key_value_heads)
        elif arch == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            value = value.T
        elif arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):
            value = value + 1.0
        writer.add_tensor(names[name], np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


_PROBE_PIECES = [
    "the", " quick", "Brown", "FOX", "jumps", "over", " lazy", "dog.", "don't", "'s", "'ll", "I'm",
    "12345", "3.14159", "2024-06-01", "e=mc^2", "x_1+y_2", " ", "  ", "   ", "\t", "\n", "\n\n",
    "\r\n", "\u00a0", "\u200b", "ünïcödé", "Ελληνικά", "русский", "العربية", "한국어", "日本語",
    "你好", "世界", "🙂", "👍🏽", "ﬁ", "Ⅻ", "€", "—", "…", "«quoted»", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
    "def f(x):", "    return x * 2", "{", "}", "[1, 2]", "https://example.org/a?b=c&d=e", "#", "@user",
    "```", "<div>", "</s>", "<s>", "a" * 40, "!!!", "???", "...",
]


def tokenizer_probe_texts(count: int = 1000, seed: int = 0) -> list[str]:
    """`count` strings of 1-12 pieces (words, digits, runs of spaces / tabs / newlines, accented,
    Greek, Cyrillic, Arabic, Korean, Japanese and Chinese text, emoji, code, the special tokens'
    text) and random code points, drawn with `random.Random(seed)`."""
    rng = random.Random(seed)

    def piece():
        if rng.random() < 0.15:
            return chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF),
                                   rng.randint(0x3000, 0x9FFF), rng.randint(0x1F300, 0x1FAFF)]))
        return rng.choice(_PROBE_PIECES)

    return ["".join(piece() for _ in range(rng.randint(1, 12))) for _ in range(count)]


def assert_same_tokenizer(ours, reference, texts: list[str]) -> None:
    """Equal ids for every text (with the special tokens each adds), equal special tokens, and
    equal decodes of every id sequence, with and without special tokens."""
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.add_bos_token) == (
        reference.bos_token, reference.eos_token, reference.unk_token, reference.add_bos_token)
    ids = ours(texts)["input_ids"]
    assert ids == reference(texts)["input_ids"]
    for skip in (False, True):
        assert ours.batch_decode(ids, skip_special_tokens=skip) == reference.batch_decode(
            ids, skip_special_tokens=skip)


# Logical rules of the model's activation constraints on a ("data", "fsdp", "tensor") mesh.
ACTIVATION_RULES = (("activation_batch", "data"), ("activation_heads", "tensor"), ("activation_kv_heads", "tensor"),
                    ("activation_mlp", "tensor"), ("activation_vocab", "tensor"), ("activation_length", None),
                    ("activation_embed", None))


def sharded_on_2x2x2(model, params):
    """(mesh of 8 devices as data x fsdp x tensor = 2 x 2 x 2, `params` placed on it by their
    logical axes: embed on fsdp, vocab / heads / kv_heads / mlp on tensor where the dimension
    splits in two, replicated elsewhere)."""
    import jax
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    import marl_jax.models as M

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"),
                axis_types=(AxisType.Auto,) * 3)
    rules = {"embed": "fsdp", "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor"}

    def place(spec, leaf):
        axes = [rules.get(name) if name in rules and leaf.shape[i] % 2 == 0 else None for i, name in enumerate(spec)]
        return NamedSharding(mesh, PartitionSpec(*axes))

    shardings = jax.tree.map(place, M.logical_axes(model), params, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return mesh, jax.device_put(params, shardings)
