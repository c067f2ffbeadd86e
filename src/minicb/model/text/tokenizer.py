"""Text <-> token ids, chat templates and streaming detokenization.

A thin wrapper around the Hugging Face ``tokenizers`` library (Rust, fast), built either from a
``tokenizer.json`` or from the vocabulary a GGUF file stores in its metadata.

**Byte-level BPE, briefly.** Text is first cut into "pre-tokens" by a regular expression (words with
their leading space, runs of punctuation, runs of whitespace; SmolLM also cuts every digit apart).
Each pre-token's UTF-8 bytes are spelled with 256 printable stand-in characters (GPT-2's
``bytes_to_unicode``: a space becomes ``Ġ``, a newline ``Ċ``), and the learned merges are applied
pairwise, best-ranked first, until no merge applies. Decoding maps every token back to its bytes and
decodes the concatenation as UTF-8. One token can therefore end in the middle of a multi-byte
character (an emoji is four bytes, often two or three tokens), which is what ``IncrementalDecoder``
handles for streaming.

**From a GGUF file.** llama.cpp stores ``tokenizer.ggml.tokens`` (already in the stand-in alphabet),
``tokenizer.ggml.merges`` (``"Ġ t"`` strings), ``tokenizer.ggml.token_type`` (1 normal, 3 control,
4 user-defined) and ``tokenizer.ggml.pre``, the name of the pre-tokenizer regex. ``_PRE_TOKENIZERS``
maps those names to the ``tokenizers`` pre-tokenizers that reproduce llama.cpp's regexes
(``llama-vocab.cpp``). SmolLM's ``smollm`` is ``\\p{N}`` (every digit alone) followed by GPT-2's
regex: the same pair as SmolLM's own ``tokenizer.json`` (``Digits(individual_digits=True)`` then
``ByteLevel``). Control tokens such as ``<|im_start|>`` become special tokens: matched whole in the
text, dropped by ``decode(skip_special_tokens=True)``.

**Chat templates** are Jinja2 programs stored with the model (``tokenizer.chat_template`` in a GGUF,
``chat_template`` in ``tokenizer_config.json``). They are rendered with the same settings as
``transformers`` (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``tojson``), so the prompt
text is the one the model was fine-tuned on, and, being untrusted code from a file, in a sandbox
bounded in time, size and memory (``minicb.model.text.chat_template``).

**Text is bounded before it is encoded.** The ``tokenizers`` library needs about 150 bytes of memory
per character of input and aborts the whole interpreter when an allocation fails, so ``encode``
refuses text longer than ``MAX_TEXT_CHARS`` and, given ``max_tokens``, text that cannot possibly fit
(more characters than ``max_tokens`` times the longest token): the caller gets ``InvalidArgument``
before the library sees the string. Text that is not valid Unicode (a lone surrogate, which is how
Python carries undecodable bytes of a command line) is refused the same way.
"""

from __future__ import annotations

import codecs
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from minicb.core.errors import InvalidArgument, ModelLoadError, as_int, describe
from minicb.model.text.chat_template import render as render_chat_template

# The longest text ``encode`` accepts: ~2 s and ~450 MB inside ``tokenizers``; longer than any context.
MAX_TEXT_CHARS = 2**21

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 3, 4

# Pre-tokenizer regexes, as llama.cpp spells them per `tokenizer.ggml.pre` (llama-vocab.cpp).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2 = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")
_LLAMA3 = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")
_QWEN2 = ("qwen2", "deepseek-r1-qwen")
SUPPORTED_PRE_TOKENIZERS = _DIGITS_THEN_GPT2 + _GPT2 + _LLAMA3 + _QWEN2


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the "stand-in alphabet" of byte-level BPE).

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, ...) are shifted to
    code points 256 and up, so a space (0x20) is ``Ġ`` (U+0120) and a newline ``Ċ`` (U+010A).
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _pre_tokenizer(name: str):
    from tokenizers import Regex, pre_tokenizers

    if name in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if name in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = _LLAMA3_SPLIT if name in _LLAMA3 else _QWEN2_SPLIT if name in _QWEN2 else None
    if split is None:
        raise ModelLoadError(f"unsupported tokenizer pre-tokenizer {name!r} (tokenizer.ggml.pre); "
                             f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _token_content(value) -> str | None:
    """A special token in tokenizer_config.json is a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode, decode, apply the chat template, stream-decode. Build with a ``from_*`` classmethod."""

    def __init__(self, backend, *, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None, chat_template: str | None = None) -> None:
        self._tk = backend                     # a tokenizers.Tokenizer
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self._special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._token_bytes: list[bytes] | None = None   # built on first incremental_decoder()
        self._max_token_chars: int | None = None        # built on first encode(max_tokens=...)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF file's ``tokenizer.*`` metadata (byte-level BPE, ``model = gpt2``)."""
        from tokenizers import AddedToken, decoders, models, processors
        from tokenizers import Tokenizer as Backend

        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"unsupported tokenizer model {kind!r} (tokenizer.ggml.model); minicb "
                                 "builds byte-level BPE tokenizers ('gpt2') from GGUF files")
        if "tokenizer.ggml.tokens" not in metadata:
            raise ModelLoadError("GGUF metadata lacks 'tokenizer.ggml.tokens' (the vocabulary)")
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types = list(metadata.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise ModelLoadError(f"GGUF metadata has {len(tokens)} tokens but {len(types)} token types")
        merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
        alphabet = set(bytes_to_unicode().values())
        # A token outside the stand-in alphabet (rare: a literal space in an added token) is re-spelled.
        vocab = {}
        for i, tok in enumerate(tokens):
            spelled = tok if set(tok) <= alphabet else "".join(bytes_to_unicode()[b] for b in tok.encode())
            vocab.setdefault(spelled, i)
        backend = Backend(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        # Control tokens match whole and are special; user-defined ones match whole but are text.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types, strict=True)
                                    if ty == TOKEN_TYPE_CONTROL and set(t) <= alphabet])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types, strict=True)
                            if ty == TOKEN_TYPE_USER_DEFINED and set(t) <= alphabet])
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:     # what encode(add_special_tokens=True) adds
            pre = [(tokens[bos], bos)] if add_bos else []
            post = [(tokens[eos], eos)] if add_eos else []
            single = " ".join([p for p, _ in pre] + ["$A"] + [p for p, _ in post])
            backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=pre + post)
        return cls(backend, bos_token_id=bos, eos_token_id=eos,
                   pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
                   chat_template=metadata.get("tokenizer.chat_template"))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Read only the header of the GGUF at ``path`` and build its tokenizer."""
        from minicb.model.weights.gguf_loader import read_gguf

        with read_gguf(path) as g:
            return cls.from_gguf_metadata(g.metadata)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Build from a Hugging Face directory: ``tokenizer.json`` plus, if present,
        ``tokenizer_config.json`` / ``chat_template.jinja`` / ``special_tokens_map.json``."""
        from tokenizers import Tokenizer as Backend

        d = pathlib.Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{d} has no tokenizer.json (minicb reads fast-tokenizer files only)")
        try:
            backend = Backend.from_file(str(tj))
        except Exception as e:  # the Rust error type is not exported
            raise ModelLoadError(f"cannot read {tj}: {e}") from e
        cfg: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):   # later files win
            f = d / name
            if f.is_file():
                try:
                    cfg.update(json.loads(f.read_text(encoding="utf-8")))
                except json.JSONDecodeError as e:
                    raise ModelLoadError(f"{f} is not valid JSON: {e}") from e
        template = cfg.get("chat_template")
        if isinstance(template, list):     # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        jinja_file = d / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        def token_id(key: str) -> int | None:
            content = _token_content(cfg.get(key))
            return None if content is None else backend.token_to_id(content)

        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   pad_token_id=token_id("pad_token"), chat_template=template)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (readable by ``from_hf_dir`` and by
        ``transformers.AutoTokenizer``)."""
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tk.save(str(d / "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key, tid in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id),
                         ("pad_token", self.pad_token_id)):
            if tid is not None:
                cfg[key] = self._tk.id_to_token(tid)
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        text = json.dumps(cfg, indent=2, ensure_ascii=False)
        (d / "tokenizer_config.json").write_text(text, encoding="utf-8")

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are matched
        whole. ``add_special_tokens`` adds what the model's files ask for (often nothing: SmolLM2
        adds no BOS; its chat template writes the markers itself).

        Refused before encoding (``InvalidArgument``): text that is not valid Unicode, text longer
        than ``MAX_TEXT_CHARS``, and with ``max_tokens`` text so long that it must encode to more than
        ``max_tokens`` tokens (each token covers at most ``max_token_chars`` characters)."""
        if not isinstance(text, str):
            raise InvalidArgument(f"text must be a str, got {type(text).__name__}")
        n = len(text)
        if n > MAX_TEXT_CHARS:
            raise InvalidArgument(f"text has {n:,} characters; minicb encodes at most {MAX_TEXT_CHARS:,}")
        if max_tokens is not None and n > max_tokens * self.max_token_chars:
            raise InvalidArgument(f"text has {n:,} characters, so at least {-(-n // self.max_token_chars):,} "
                                  f"tokens (the longest token is {self.max_token_chars} characters): more "
                                  f"than the {max_tokens:,} allowed")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidArgument(f"text is not valid Unicode: {describe(text[e.start])} at index {e.start} "
                                  "(a lone surrogate; bytes that were not UTF-8?)") from None
        # encode_batch, not encode: the same ids, but it releases the GIL while the Rust code runs, so a
        # long text tokenized in one thread (``minicb serve``'s frontend) does not stall the others
        return self._tk.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (at least 1): the longest token's
        spelling or bytes, whichever is longer (a character is at least one byte)."""
        if self._max_token_chars is None:
            table = self._byte_table()
            longest = max((len(b) for b in table), default=1) if table is not None else 1
            for i in range(self.vocab_size):
                longest = max(longest, len(self._tk.id_to_token(i) or ""))
            self._max_token_chars = max(longest, 1)
        return self._max_token_chars

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as plain ints (numpy / torch integers welcome), each checked to be in the vocabulary."""
        out = []
        for i in ids:
            v = as_int(i)              # bools and boolean tensors are not token ids
            if v is None or not 0 <= v < self.vocab_size:
                raise InvalidArgument(f"token ids must be integers in [0, {self.vocab_size - 1}], "
                                      f"got {describe(i)}")
            out.append(v)
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens (``<|im_end|>``) are left out unless asked for."""
        return self._tk.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(self, messages: list[dict] | str, add_generation_prompt: bool = True) -> str:
        """Render the model's chat template. A plain string is one user message.

        With ``add_generation_prompt`` the text ends with the assistant's header
        (``<|im_start|>assistant\\n`` for ChatML), so generation continues as the assistant.
        """
        if self.chat_template is None:
            raise InvalidArgument("this tokenizer has no chat_template; pass plain text prompts instead")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not isinstance(messages, list) or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise InvalidArgument("messages must be a str or a list of {'role': str, 'content': str} dicts")
        if not isinstance(add_generation_prompt, bool):
            raise InvalidArgument(f"add_generation_prompt must be a bool, got "
                                  f"{describe(add_generation_prompt)}")
        special = {name: None if tid is None else self._tk.id_to_token(tid)
                   for name, tid in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id),
                                     ("pad_token", self.pad_token_id))}
        return render_chat_template(self.chat_template, messages=messages,
                                    add_generation_prompt=add_generation_prompt, **special)

    # ------------------------------------------------------------------ streaming

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A decoder to feed one generated token at a time (see ``IncrementalDecoder``)."""
        return IncrementalDecoder(self, skip_special_tokens)

    def _byte_table(self) -> list[bytes] | None:
        """Each token's bytes, if this is a byte-level tokenizer (else ``None``)."""
        from tokenizers import decoders

        if not isinstance(self._tk.decoder, decoders.ByteLevel):
            return None
        if self._token_bytes is None:
            u2b = _unicode_to_bytes()
            table = []
            for i in range(self.vocab_size):
                tok = self._tk.id_to_token(i) or ""
                # The ByteLevel decoder's rule: a token wholly in the alphabet is bytes in disguise,
                # anything else (an added token with other characters) is its own UTF-8 text.
                try:
                    table.append(bytes(u2b[c] for c in tok))
                except KeyError:
                    table.append(tok.encode("utf-8"))
            self._token_bytes = table
        return self._token_bytes


class IncrementalDecoder:
    """Turns a stream of token ids into a stream of text, one ``push`` per generated token.

    ``push(token_id)`` returns the text that became complete with this token, possibly ``""``: a
    token that ends inside a multi-byte UTF-8 character holds those bytes back until the token that
    completes the character arrives. ``flush()`` returns whatever is still held at the end (invalid
    bytes become U+FFFD, as in ``decode``). The concatenation of every ``push`` and the final
    ``flush`` equals ``tokenizer.decode(all_ids)``.

    For byte-level tokenizers this is exact and O(1) per token: append the token's bytes to Python's
    incremental UTF-8 decoder. Other tokenizers (SentencePiece-style decoders) use vLLM's scheme:
    re-decode a short window of recent ids and emit the part past what was already emitted, holding
    back while the window ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._bytes = tokenizer._byte_table()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []          # the generic path's window
        self._prefix = self._read = 0
        self.text = ""                     # everything emitted so far

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text."""
        (token_id,) = self._tok._check_ids([token_id])
        if self._skip and token_id in self._tok.all_special_ids:
            return ""
        if self._bytes is not None:
            out = self._utf8.decode(self._bytes[token_id])
        else:
            out = self._push_generic(token_id)
        self.text += out
        return out

    def push_many(self, token_ids, final: bool = False) -> str:
        """``push`` each token (and ``flush`` if ``final``), all or nothing: if any of it raises, the
        decoder is put back as it was before the call, so the same tokens can be pushed again."""
        state = (self._utf8.getstate(), len(self._ids), self._prefix, self._read, self.text)
        try:
            out = "".join([self.push(t) for t in token_ids])
            if final:
                out += self.flush()
        except BaseException:
            utf8, n, self._prefix, self._read, self.text = state
            self._utf8.setstate(utf8)
            del self._ids[n:]
            raise
        return out

    def _push_generic(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        full = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """The text still held back at the end of the stream."""
        if self._bytes is not None:
            out = self._utf8.decode(b"", final=True)
        else:
            prefix = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
            full = self._tok.decode(self._ids[self._prefix:], self._skip)
            out = full[len(prefix):]
            self._prefix = self._read = len(self._ids)
        self.text += out
        return out
