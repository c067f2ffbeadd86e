"""A tiny byte-level BPE tokenizer for tests that need one without the real model: its GGUF metadata
(``tiny_gguf_tokenizer_metadata``), the ChatML template, and sample texts that exercise every
pre-tokenizer rule (``SAMPLE``). Shared by tests/model, tests/engine and ``tiny_files``.
"""

from __future__ import annotations

import functools

from minicb.model.text.tokenizer import Tokenizer, bytes_to_unicode

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ Ġ", "e r", "Ġ a"]

SAMPLE = [
    "Hello world", "The capital of France is Paris.", "1234567", "x 12 y", "3.14159 and 2,718",
    "  leading spaces", "trailing spaces   ", "many     spaces", "a\n\n\nb", "\r\n\r\n",
    "\tdef f(x):\n\t\treturn x + 1  # comment\n", "if (a && b) { return -1; }",
    "日本語のテキスト、中文。한국어", "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>tail", "I'm you're they'll we've", "ÀÉÎõü ß Ωμέγα",
    "word\u00a0nbsp", "x=1;y=22;z=333", " ", "", "a" * 60, "tokens\u200bzero width", "mixed123abc456",
]


def tiny_gguf_tokenizer_metadata(**overrides) -> dict:
    """GGUF ``tokenizer.*`` metadata of a tiny byte-level BPE: 3 control tokens, the 256 bytes, and
    the tokens of ``MERGES``."""
    tokens = SPECIALS + [bytes_to_unicode()[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)),
        "tokenizer.ggml.merges": list(MERGES),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    md.update(overrides)
    return md


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(tiny_gguf_tokenizer_metadata())
