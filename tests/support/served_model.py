"""A tiny model that ``vllm serve`` can serve with text: random Llama weights plus a tokenizer.

``write_served_model`` is the only thing the server tests need from a model; to test on another
model (for example the small pair under ``models/``), make the ``served_model`` fixture in
``tests/server/conftest.py`` return its directory instead.

The tokenizer is byte-level BPE without merges (every byte is a token), written offline with
``tokenizers``: ids 0 and 1 are ``<s>`` and ``</s>`` (the model's bos/eos), then the 256 byte
symbols, then filler tokens up to the model's vocabulary, so every id the model can produce
decodes. The chat template is one line per message.
"""

from __future__ import annotations

from pathlib import Path

from vllm_nwor.testing import write_tiny_llama_pair

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_byte_tokenizer(directory: str | Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def write_served_model(root: str | Path) -> str:
    """Writes ``root/target`` (3-layer random Llama, vocabulary 512, tokenizer); returns it."""
    target, _ = write_tiny_llama_pair(root, num_layers=3, draft_layers=1)
    write_byte_tokenizer(target, vocab_size=512)
    return target
