"""Word-level chat tokenizers for the environments' own small vocabularies.

A real `tokenizers` WordLevel tokenizer (whitespace split) with ChatML's special tokens and
SmolLM2's ChatML chat template minus its default system message, saved to disk and loaded
through `transformers.AutoTokenizer` like any pretrained model's tokenizer. Its end-of-turn
token is `<|im_end|>`, also its EOS; decoding joins words with single spaces.
"""
from __future__ import annotations

from typing import Sequence

from marl_jax.models.tokenizer import write_tokenizer

PAD, UNK, IM_START, IM_END = "<pad>", "<unk>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, UNK, IM_START, IM_END)
ROLES = ("system", "user", "assistant", "tool")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chat_vocabulary(words: Sequence[str]) -> list:
    """The special tokens, the chat roles, then `words` (duplicates dropped, order kept)."""
    vocab = list(dict.fromkeys([*SPECIAL_TOKENS, *ROLES, *words]))
    spaced = [w for w in vocab if not w or any(c.isspace() for c in w)]
    if spaced:
        raise ValueError(f"vocabulary words must be non-empty and hold no whitespace: {spaced}")
    return vocab


def build_word_chat_tokenizer(words: Sequence[str], directory: str):
    """Writes the word-level chat tokenizer of `words` to `directory`; returns it loaded by
    transformers. Every process writes its own temporary copy and renames the first complete one
    into place, so concurrent processes never read a half-written file."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = chat_vocabulary(words)
    raw = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(vocab)}, unk_token=UNK))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token=PAD, unk_token=UNK,
                                   eos_token=IM_END, additional_special_tokens=[IM_START],
                                   chat_template=CHATML_TEMPLATE, padding_side="left")
    return write_tokenizer(fast, directory)
