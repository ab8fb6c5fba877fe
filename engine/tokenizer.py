"""GGUF vocabularies: text ↔ token ids, identical to llama.cpp's tokenizer.

Two models, chosen by ``tokenizer.ggml.model``: ``gpt2`` (byte-level BPE, `tokenizer_bpe`) and
``llama`` (SentencePiece, `tokenizer_spm`). Both share the steps here, as in llama.cpp:

- special-token partition: special tokens are cut out of the text as whole strings, longest
  first; control and unknown tokens only with ``parse_special=True``, user-defined tokens always
  (Gemma's "\\n", "  ", "<table>" ... are user-defined and always matched);
- the text between them goes through the model;
- BOS / EOS are added when ``add_special`` and the GGUF asks for them.

Decoding follows llama.cpp's ``token_to_piece``: control / unknown / user-defined tokens give
their text (control and unknown give nothing with ``skip_special=True``), byte-level BPE tokens
their bytes, SentencePiece tokens their text with "▁" → " " and ``<0xNN>`` → the byte.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import ModelFormatError
from .gguf_file import GGUFFile
from .tokenizer_bpe import PRE_TOKENIZERS, BPEModel, byte_decode
from .tokenizer_spm import SPACE_MARK, SPMModel

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token attributes (llama.cpp's llama_token_attr bit flags): a type becomes one flag, and
# llama.cpp's text-based detection may add CONTROL to a user-defined token.
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = (
    1, 2, 4, 8, 16, 32,
)  # fmt: skip
_TYPE_TO_ATTR = {
    NORMAL: ATTR_NORMAL, UNKNOWN: ATTR_UNKNOWN, CONTROL: ATTR_CONTROL,
    USER_DEFINED: ATTR_USER_DEFINED, UNUSED: ATTR_UNUSED, BYTE: ATTR_BYTE,
}  # fmt: skip
_ATTR_SPECIAL = ATTR_CONTROL | ATTR_UNKNOWN
"""Parsed only with parse_special, dropped by skip_special."""
_ATTR_WHOLE = ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED
"""Matched as whole strings before tokenizing and decoded as their plain text."""

# Texts by which llama.cpp (llama-vocab.cpp, commit of the fixtures) recognises end-of-turn,
# end-of-message and fill-in-the-middle tokens when the GGUF names no id (first match wins).
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<end_of_utterance>",
)  # fmt: skip
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<|code_prefix|>",
                "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<|code_suffix|>",
                "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<|code_middle|>",
                "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
# Every token with one of these texts ends generation (and is made a control token).
EOG_TEXTS = frozenset(
    [
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>",
        "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
        "<|tool_response>",
    ]
)  # fmt: skip
# gpt-oss: always rendered, so llama.cpp makes them plain user-defined tokens.
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

_SUPPORTED_MODELS = ("gpt2", "llama")


class Tokenizer:
    """A GGUF vocabulary: `encode`, `decode` and the special ids, as llama.cpp computes them."""

    def __init__(
        self,
        *,
        kind: str,
        tokens: list[str],
        attrs: list[int],
        model: BPEModel | SPMModel,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        eog_ids: frozenset[int],
    ) -> None:
        self.kind = kind
        """"bpe" or "spm"."""
        self.tokens = tokens
        self.attrs = attrs
        """llama.cpp token attributes (ATTR_* flags) per id, after its text-based overrides."""
        self.model = model
        self.n_vocab = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos and bos_id is not None
        self.add_eos = add_eos and eos_id is not None
        self.add_space_prefix = add_space_prefix
        self.eog_ids = eog_ids
        self._token_to_id = model.token_to_id
        specials = [i for i, a in enumerate(attrs) if a & _ATTR_WHOLE and tokens[i]]
        specials.sort(key=lambda i: (-len(tokens[i].encode("utf-8")), i))
        self._specials_all = [(tokens[i], i) for i in specials]
        self._specials_text = [(tokens[i], i) for i in specials if not attrs[i] & _ATTR_SPECIAL]
        self._pieces: list[bytes | None] = [None] * self.n_vocab

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Tokenizer:
        """Build the tokenizer described by the ``tokenizer.ggml.*`` keys of `gf`."""
        path = gf.path
        name = gf.get("tokenizer.ggml.model")
        if name is None:
            raise ModelFormatError(path, "tokenizer.ggml.model", "required metadata key is missing")
        if name not in _SUPPORTED_MODELS:
            raise ModelFormatError(
                path,
                "tokenizer.ggml.model",
                f"tokenizer model {name!r} is not supported (supported: gpt2, llama)",
            )
        tokens = gf.require("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ModelFormatError(path, "tokenizer.ggml.tokens", "expected a non-empty string array")
        n = len(tokens)
        attrs = _attributes(gf, n)
        # A text that occurs twice maps to its last id, as in llama.cpp.
        token_to_id = dict(zip(tokens, range(n), strict=True))
        pre_name = gf.get("tokenizer.ggml.pre")
        model: BPEModel | SPMModel
        if name == "gpt2":
            pre_key = "default" if pre_name in (None, "") else str(pre_name)
            pre = PRE_TOKENIZERS.get(pre_key)
            if pre is None:
                raise ModelFormatError(
                    path,
                    "tokenizer.ggml.pre",
                    f"unknown pre-tokenizer {pre_key!r} (supported: {', '.join(sorted(PRE_TOKENIZERS))})",
                )
            merges = gf.require("tokenizer.ggml.merges")
            if not isinstance(merges, list):
                raise ModelFormatError(path, "tokenizer.ggml.merges", "expected a string array")
            model = BPEModel(token_to_id, merges, pre)
            kind = "bpe"
            default_bos, default_eos = None, None
            add_bos_default, add_space_default = pre.add_bos, False
        else:
            if pre_name not in (None, "", "default"):
                raise ModelFormatError(
                    path,
                    "tokenizer.ggml.pre",
                    f"unknown pre-tokenizer {pre_name!r} for a SentencePiece vocabulary (expected 'default')",
                )
            scores_arr = gf.get("tokenizer.ggml.scores")
            if scores_arr is None:
                scores = [0.0] * n
            else:
                scores = np.asarray(scores_arr, dtype=np.float64).tolist()
                if len(scores) != n:
                    raise ModelFormatError(path, "tokenizer.ggml.scores", f"has {len(scores)} entries for {n} tokens")
            unk = _special_id(gf, "tokenizer.ggml.unknown_token_id", 0, n)
            byte_ids = []
            for b in range(256):
                tid = token_to_id.get(f"<0x{b:02X}>")
                if tid is None:
                    tid = token_to_id.get(chr(b), unk if unk is not None else 0)
                byte_ids.append(tid)
            model = SPMModel(token_to_id, scores, byte_ids)
            kind = "spm"
            default_bos, default_eos = 1, 2
            add_bos_default, add_space_default = True, True
        bos_id = _special_id(gf, "tokenizer.ggml.bos_token_id", default_bos, n)
        eos_id = _special_id(gf, "tokenizer.ggml.eos_token_id", default_eos, n)
        add_bos = bool(gf.get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(gf.get("tokenizer.ggml.add_eos_token", False))
        add_space_prefix = bool(gf.get("tokenizer.ggml.add_space_prefix", add_space_default))
        eog = _end_of_generation(gf, token_to_id, attrs, eos_id)
        return cls(
            kind=kind,
            tokens=tokens,
            attrs=attrs,
            model=model,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            eog_ids=eog,
        )

    # ------------------------------------------------------------------ lookups
    def token_id(self, text: str) -> int | None:
        """Id of the token whose text is exactly `text`, or None."""
        return self._token_to_id.get(text)

    def is_special(self, id: int) -> bool:
        """True for control, user-defined and unknown tokens (matched whole, never merged)."""
        return bool(self.attrs[self._check(id)] & _ATTR_WHOLE)

    def is_eog(self, id: int) -> bool:
        """True when `id` ends generation."""
        return id in self.eog_ids

    def _check(self, id: int) -> int:
        if not 0 <= id < self.n_vocab:
            raise ValueError(f"token id {id} is out of range [0, {self.n_vocab})")
        return id

    # ------------------------------------------------------------------ encode
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`: BOS/EOS per the GGUF with `add_special`, special texts parsed with `parse_special`."""
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates: tokenize their replacement
                text = text.encode("utf-8", "replace").decode("utf-8")
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        fragments = self._partition(text, parse_special) if text else []
        model = self.model
        if isinstance(model, SPMModel):
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                else:
                    if self.add_space_prefix and prev_special:
                        frag = " " + frag
                    model.encode(frag, out)
                    prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    model.encode(frag, out)
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of `text`, each token over all fragments, longest first."""
        specials = self._specials_all if parse_special else self._specials_text
        frags: list[str | int] = [text]
        present = set(text)
        for tok_text, tid in specials:
            if tok_text[0] not in present or tok_text not in text:
                continue
            new: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok_text not in frag:
                    new.append(frag)
                    continue
                for k, part in enumerate(frag.split(tok_text)):
                    if k:
                        new.append(tid)
                    if part:
                        new.append(part)
            frags = new
        return frags

    # ------------------------------------------------------------------ decode
    def token_to_bytes(self, id: int) -> bytes:
        """Bytes token `id` contributes to decoded text (special tokens as their text)."""
        piece = self._pieces[self._check(id)]
        if piece is None:
            piece = self._make_piece(id)
            self._pieces[id] = piece
        return piece

    def _make_piece(self, id: int) -> bytes:
        attr = self.attrs[id]
        text = self.tokens[id]
        if attr & _ATTR_WHOLE:
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.kind == "bpe":
                return byte_decode(text)
            return text.replace(SPACE_MARK, " ").encode("utf-8")
        if attr & ATTR_BYTE and self.kind == "spm":
            return bytes((_byte_value(text),))
        return b""  # unused / undefined tokens render as nothing, as in llama.cpp

    def _piece(self, id: int, skip_special: bool) -> bytes:
        if skip_special and self.attrs[self._check(id)] & _ATTR_SPECIAL:
            return b""
        return self.token_to_bytes(id)

    def decode_bytes(self, ids: Sequence[int], skip_special: bool = False) -> bytes:
        """Concatenated bytes of `ids` (may end inside a UTF-8 character)."""
        parts = [self._piece(int(i), skip_special) for i in ids]
        if parts and self.add_space_prefix and self.attrs[int(ids[0])] & ATTR_NORMAL:
            if parts[0].startswith(b" "):
                parts[0] = parts[0][1:]  # the space encode() added in front
        return b"".join(parts)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid or truncated UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")


class StreamDecoder:
    """Incremental decode: feed ids one by one, get back only complete UTF-8 text."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def feed(self, id: int) -> str:
        """Text completed by token `id` ("" while a multi-byte character is still split)."""
        tok = self.tokenizer
        piece = tok._piece(int(id), self.skip_special)
        if self._first:
            self._first = False
            if tok.add_space_prefix and tok.attrs[int(id)] & ATTR_NORMAL and piece.startswith(b" "):
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD); resets the decoder."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out


def build_tokenizer(gf: GGUFFile) -> Tokenizer:
    """Alias of `Tokenizer.from_gguf`."""
    return Tokenizer.from_gguf(gf)


# ---------------------------------------------------------------------- helpers
def _special_id(gf: GGUFFile, key: str, default: int | None, n: int) -> int | None:
    value: Any = gf.get(key, default)
    if value is None:
        return None
    value = int(value)
    if value == -1 or value == 0xFFFFFFFF:
        return None
    if not 0 <= value < n:
        raise ModelFormatError(gf.path, key, f"token id {value} is outside the vocabulary of {n}")
    return value


def _byte_value(text: str) -> int:
    """255 for "<0xFF>"; a byte token with another spelling maps to its first UTF-8 byte."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            pass
    return text.encode("utf-8")[0] if text else 0


def _attributes(gf: GGUFFile, n: int) -> list[int]:
    """llama.cpp attribute flags from ``tokenizer.ggml.token_type`` (all normal when absent)."""
    key = "tokenizer.ggml.token_type"
    value = gf.get(key)
    if value is None:
        return [ATTR_NORMAL] * n
    types = np.asarray(value)
    if types.ndim != 1 or len(types) != n or not np.issubdtype(types.dtype, np.integer):
        raise ModelFormatError(gf.path, key, f"expected {n} integers, found {types.shape} {types.dtype}")
    table = np.zeros(8, dtype=np.int64)
    for ttype, attr in _TYPE_TO_ATTR.items():
        table[ttype] = attr
    known = (types >= 0) & (types < len(table))
    return np.where(known, table[np.clip(types, 0, len(table) - 1)], 0).tolist()


def _end_of_generation(
    gf: GGUFFile, token_to_id: dict[str, int], attrs: list[int], eos_id: int | None
) -> frozenset[int]:
    """llama.cpp's end-of-generation set; updates `attrs` in place the way llama.cpp does.

    eos, eot, eom and the fim pad/repo/sep tokens (from their GGUF keys, else found by text),
    plus every token whose text is in EOG_TEXTS. Tokens found by text gain the control flag.
    """
    n = len(attrs)

    def by_key_or_text(key: str, texts: tuple[str, ...]) -> int | None:
        tid = _special_id(gf, f"tokenizer.ggml.{key}_token_id", None, n)
        if tid is not None:
            return tid
        tid = next((token_to_id[t] for t in texts if t in token_to_id), None)
        if tid is not None:
            attrs[tid] |= ATTR_CONTROL
        return tid

    eot = by_key_or_text("eot", _EOT_TEXTS)
    eom = by_key_or_text("eom", _EOM_TEXTS)
    fim = {name: by_key_or_text(name, texts) for name, texts in _FIM_TEXTS.items()}
    eog: set[int] = {t for t in (fim["fim_pad"], fim["fim_rep"], fim["fim_sep"]) if t is not None}
    for text in EOG_TEXTS:
        tid = token_to_id.get(text)
        if tid is not None:
            eog.add(tid)
            attrs[tid] |= ATTR_CONTROL
    for text in _ALWAYS_RENDERED:
        if text in token_to_id:
            attrs[token_to_id[text]] = ATTR_USER_DEFINED
    eog.update(t for t in (eos_id, eot, eom) if t is not None)
    texts = {id_: (gf.metadata["tokenizer.ggml.tokens"][id_]) for id_ in eog}
    present = set(texts.values())
    end_id = next((i for i, t in texts.items() if t == "<|end|>"), None)
    has_call = "<|call|>" in present or "<|calls|>" in present
    if end_id is not None and has_call and ("<|return|>" in present or "<|flush|>" in present):
        eog.discard(end_id)  # harmony / solar-open: <|end|> ends a message, not generation
        attrs[end_id] = ATTR_USER_DEFINED
    s_id = next((i for i, t in texts.items() if t == "</s>"), None)
    if s_id is not None and "<|tool_response>" in present:
        eog.discard(s_id)  # gemma4: </s> is text there
        attrs[s_id] = ATTR_NORMAL
    return frozenset(eog)
