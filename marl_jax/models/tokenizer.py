"""Tokenizers through transformers, from an HF directory or a GGUF file, without torch.

transformers' own GGUF entry point (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) imports
torch to read the file header, so for GGUF we read the metadata with the `gguf` package, build the
tokenizer it describes with the `tokenizers` library, and hand that to transformers' public
`TokenizersBackend`. The pipelines below are the ones transformers builds for the same files
(its `GPT2Tokenizer`, `LlamaTokenizer` and `GemmaTokenizer`, and the per-file fixes of its GGUF
converter, as of transformers 5.24), written out so that the result is the same on every
transformers release the project supports; tests/test_models.py compares the two token by token.
"""
from __future__ import annotations

import os
import pathlib
import struct

import numpy as np

# GGUF metadata key -> transformers tokenizer_config keys.
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
# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Byte-level vocabularies split text before BPE by the regex their merges were learned with,
# named by tokenizer.ggml.pre; any other name gets GPT-2's split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable},
            **{b: chr(256 + i) for i, b in enumerate(others)}}


def _merges_from_vocabulary(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary without a merge list: every split of a token into two
    tokens, best `rank` first (ties: shorter left, then shorter right part)."""
    index = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token, score in rank.items():
        pairs = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in index and token[i:] in index]
        merges.extend(sorted(pairs, key=lambda p: (index[p[0]], index[p[1]])))
    merges.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _file_merges(metadata: dict) -> list[tuple[str, str]] | None:
    merges = metadata.get("tokenizer.ggml.merges")
    return None if merges is None else [tuple(merge.split(" ")) for merge in merges]


def _byte_level_backend(metadata: dict):
    """GPT-2 style byte-level BPE (tokenizer.ggml.model = gpt2: GPT-2, Llama 3, Qwen, SmolLM2)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): i
             for i, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=_file_merges(metadata) or [], dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, ["<|endoftext|>"], alphabet


def _sentencepiece_backend(metadata: dict, architecture: str):
    """Sentencepiece-style BPE with byte fallback (tokenizer.ggml.model = llama: Llama 2,
    Mistral, Gemma 1-3, Phi-3)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = list(metadata["tokenizer.ggml.tokens"])
    if architecture in ("gemma", "gemma2", "gemma3"):
        # Gemma files store a token of two or more spaces as spaces, which the tokenizer looks up
        # as "▁▁"; they list no merges, and the merges' order is the tokens' order in the file
        # (their scores do not follow it).
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {token: i for i, token in enumerate(tokens)}
        merges = _merges_from_vocabulary(tokens, {token: -i for i, token in enumerate(tokens)})
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>",
                                       dropout=None, byte_fallback=True))
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous",
                                                     invert=False)
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                             decoders.Fuse()])
        return backend, ["<bos>", "<eos>", "<unk>", "<pad>", "<mask>"], None
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = _file_merges(metadata)
    if merges is None:
        merges = _merges_from_vocabulary(tokens, dict(zip(tokens, metadata["tokenizer.ggml.scores"])))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                   dropout=None))
    if architecture == "phi3":
        # Phi-3 writes its prefix space with a normalizer: "  hi" -> "▁▁▁hi".
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                         split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    return backend, ["<s>", "</s>", "<unk>"], None


# GGUF metadata value types: struct formats of the scalars, and the two compound types.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_metadata(path: pathlib.Path) -> dict:
    """`general.architecture` and the `tokenizer.*` values of a GGUF file (v2 / v3, little-endian),
    as `gguf.GGUFReader(path).fields[key].contents()` gives them, read from the metadata section
    alone: GGUFReader parses every field into numpy views first, 10-40 s for a 262k vocabulary."""
    import mmap

    wanted = lambda key: key.startswith("tokenizer.") or key == "general.architecture"  # noqa: E731
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version = struct.unpack_from("<4sI", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a little-endian GGUF v2 / v3 file")
        count, = struct.unpack_from("<Q", buf, 16)
        offset = 24

        def string():
            nonlocal offset
            length, = struct.unpack_from("<Q", buf, offset)
            offset += 8 + length
            return buf[offset - length:offset].decode("utf-8")

        def value(kind, keep):
            nonlocal offset
            if kind == _GGUF_STRING:
                return string()
            if kind in _GGUF_SCALARS:
                fmt = _GGUF_SCALARS[kind]
                offset += struct.calcsize(fmt)
                return struct.unpack_from(fmt, buf, offset - struct.calcsize(fmt))[0]
            if kind != _GGUF_ARRAY:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")
            item, length = struct.unpack_from("<IQ", buf, offset)
            offset += 12
            if item in _GGUF_SCALARS:
                dtype = np.dtype(_GGUF_SCALARS[item])
                values = np.frombuffer(buf, dtype, length, offset).tolist() if keep else None
                offset += dtype.itemsize * length
                return values
            return [value(item, keep) for _ in range(length)]

        metadata = {}
        for _ in range(count):
            key = string()
            kind, = struct.unpack_from("<I", buf, offset)
            offset += 4
            found = value(kind, wanted(key))
            if wanted(key):
                metadata[key] = found
    return metadata


def _gguf_tokenizer(path: pathlib.Path):
    from tokenizers import AddedToken
    from transformers import TokenizersBackend

    metadata = _gguf_metadata(path)
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{path}: the GGUF file carries no tokenizer (tokenizer.ggml.tokens is missing)")
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend, class_tokens, alphabet = _byte_level_backend(metadata)
    elif kind == "llama":
        backend, class_tokens, alphabet = _sentencepiece_backend(metadata, metadata["general.architecture"])
    else:
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} is not supported; supported: gpt2, llama")
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or ()
    # Control tokens stay whole as special tokens, user-defined ones (e.g. `<think>`) as plain added
    # tokens. A control token outside a byte-level alphabet is a mislabel of the file: adding it
    # would grow the vocabulary past the model's.
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in class_tokens])
    backend.add_special_tokens([
        AddedToken(token, normalized=False, special=True) for token, token_type in zip(tokens, types)
        if token_type == _CONTROL and (alphabet is None or set(token) <= alphabet)])
    vocab = backend.get_vocab()
    backend.add_tokens([AddedToken(token, normalized=False, special=False)
                        for token, token_type in zip(tokens, types)
                        if token_type == _USER_DEFINED and token in vocab])

    config = {name: metadata[key] for key, name in _CONFIG_FIELDS.items() if key in metadata}
    if kind == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(key)
        config[name] = tokens[token_id] if token_id is not None else None
    return TokenizersBackend(tokenizer_object=backend, **config)


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


def write_tokenizer(fast, directory: str):
    """Saves the `transformers` tokenizer `fast` to `directory` and returns it loaded back by
    `AutoTokenizer`, the path of any pretrained model's tokenizer. Every process writes its own
    temporary copy and loads that; the first complete copy is renamed into place, so concurrent
    processes never read a half-written file."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)
    fast.save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    try:
        os.rename(tmp, directory)
    except OSError:  # another process got there first; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
