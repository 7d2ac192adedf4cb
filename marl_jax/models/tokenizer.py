"""Tokenizers through transformers, from an HF directory or a GGUF file, without torch.

transformers' own GGUF entry point (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) imports
torch to read the file header, so for GGUF we read the metadata with the `gguf` package and hand
it to transformers' GGUF tokenizer converter, which builds the same fast tokenizer.
"""
from __future__ import annotations

import importlib
import os
import pathlib

# GGUF metadata key -> transformers' tokenizer_dict / tokenizer_config keys
# (transformers.integrations.gguf.gguf_tokenizer_mapping.GGUF_TOKENIZER_MAPPING).
_TOKENIZER_FIELDS = {
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.precompiled_charsmap": "precompiled_charsmap",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}
_CONFIG_FIELDS = {
    "tokenizer.chat_template": "chat_template",
    "tokenizer.ggml.add_bos_token": "add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_eos_token",
}
_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _gguf_tokenizer(path: pathlib.Path):
    import gguf
    from transformers import TokenizersBackend

    converter = importlib.import_module("transformers.integrations.gguf.gguf_tokenizer_mapping")
    reader = gguf.GGUFReader(str(path))
    metadata = {key: field.contents() for key, field in reader.fields.items()
                if key.startswith("tokenizer.") or key == "general.architecture"}
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{path}: the GGUF file carries no tokenizer (tokenizer.ggml.tokens is missing)")
    tokenizer_dict = {name: metadata[key] for key, name in _TOKENIZER_FIELDS.items() if key in metadata}
    config = {name: metadata[key] for key, name in _CONFIG_FIELDS.items() if key in metadata}
    if tokenizer_dict.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(key)
        config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = converter.convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return TokenizersBackend(tokenizer_object=backend, **config, **extra)


def load_tokenizer(path: str | os.PathLike, *, padding_side: str = "left"):
    """A transformers fast tokenizer from an HF directory (or hub-style name already cached) or a
    `.gguf` file. Prompts in RLHF are left-padded, hence `padding_side="left"`; a tokenizer without
    a pad token gets its EOS token as pad."""
    path = pathlib.Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such GGUF file")
        tokenizer = _gguf_tokenizer(path)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
