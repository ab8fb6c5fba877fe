"""Byte-level BPE (the GPT-2 family: ``tokenizer.ggml.model = gpt2``), as llama.cpp runs it.

Three steps per raw-text fragment:
1. pre-tokenize: the regexes chosen by ``tokenizer.ggml.pre`` are applied one after the other,
   each splitting every piece of the previous one further (text between matches stays a piece);
2. byte-encode every piece: UTF-8 bytes mapped to GPT-2's printable stand-in characters;
3. merge: repeatedly merge the adjacent pair with the lowest merge rank (leftmost on ties).

Python's ``re`` has no ``\\p{L}``; the letter, number and punctuation classes are built once from
``unicodedata`` as explicit code-point ranges, which keeps the splitting in C.
"""

from __future__ import annotations

import re
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .tokenizer_merge import merge_pairs

# llama.cpp's whitespace set (the Unicode White_Space property); Python's str.isspace() differs.
_WHITESPACE = [
    0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680,
    *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
]  # fmt: skip

# Letters, numbers and punctuation all lie in planes 0-3.
_SCAN_LIMIT = 0x40000


def _esc(cp: int) -> str:
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


def _ranges(cps: list[int]) -> str:
    """Character-class body for a sorted list of code points, e.g. ``\\u0041-\\u005a``."""
    out: list[str] = []
    i = 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        out.append(_esc(cps[i]) if i == j else f"{_esc(cps[i])}-{_esc(cps[j])}")
        i = j + 1
    return "".join(out)


def _class_ranges(majors: np.ndarray, letter: str) -> str:
    """Character-class body of the code points whose major category is `letter` (runs as ranges)."""
    mask = np.concatenate(([False], majors == ord(letter), [False]))
    edges = np.flatnonzero(mask[1:] != mask[:-1])  # run starts and ends (exclusive), alternating
    return "".join(
        _esc(a) if b - a == 1 else f"{_esc(a)}-{_esc(b - 1)}"
        for a, b in zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True)
    )


@lru_cache(maxsize=1)
def unicode_classes() -> dict[str, str]:
    """Class bodies for ``L`` (letters), ``N`` (numbers), ``P`` (punctuation), ``W`` (whitespace)."""
    # Every code point as one string, decoded from UTF-32 in one call (not a chr() each); the
    # surrogates cannot be decoded, so spaces stand in for them and their class is set to C after.
    cps = np.arange(_SCAN_LIMIT, dtype="<u4")
    cps[0xD800:0xE000] = 0x20
    text = cps.tobytes().decode("utf-32-le")
    # categories are two ASCII letters: every other byte of their concatenation is the major class
    cats = "".join(map(unicodedata.category, text)).encode("ascii")[::2]
    majors = np.frombuffer(cats, np.uint8).copy()
    majors[0xD800:0xE000] = ord("C")  # Cs
    classes = {k: _class_ranges(majors, k) for k in ("L", "N", "P")}
    classes["W"] = _ranges(_WHITESPACE)
    return classes


def _expand(pattern: str) -> re.Pattern[str]:
    """Compile a pattern written with ``{L}``, ``{N}``, ``{P}``, ``{W}`` class-body placeholders."""
    c = unicode_classes()
    for key in ("L", "N", "P", "W"):
        pattern = pattern.replace("{" + key + "}", c[key])
    return re.compile(pattern)


# The patterns of llama.cpp's llm_tokenizer_bpe, with \s → [{W}] and \S → [^{W}].
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{W}{L}{N}]+|[{W}]+(?![^{W}])|[{W}]+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n{L}{N}]?[{L}]+|[{N}]{1,3}| ?[^{W}{L}{N}]+[\r\n]*"
    r"|[{W}]*[\r\n]+|[{W}]+(?![^{W}])|[{W}]+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n{L}{N}]?[{L}]+|[{N}]| ?[^{W}{L}{N}]+[\r\n]*"
    r"|[{W}]*[\r\n]+|[{W}]+(?![^{W}])|[{W}]+"
)
_ONE_DIGIT = r"[{N}]"


@dataclass(frozen=True)
class PreTokenizer:
    """How one ``tokenizer.ggml.pre`` value splits text before merging."""

    patterns: tuple[str, ...]
    """Regexes applied in order, each one splitting the pieces of the previous one."""
    ignore_merges: bool = False
    """A piece that is itself a vocabulary token is taken whole (llama3)."""
    add_bos: bool = False
    """llama.cpp's default for add_bos when the GGUF has no ``tokenizer.ggml.add_bos_token``."""


_DEFAULT = PreTokenizer(
    (r"[{P}\$\+<=>\^~\|]+", _GPT2, r"[{N}]+", r"[0-9][0-9][0-9]"),
)
_PRE_GPT2 = PreTokenizer((_GPT2,))
_PRE_DIGITS_GPT2 = PreTokenizer((_ONE_DIGIT, _GPT2))
_PRE_LLAMA3 = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_QWEN2 = PreTokenizer((_QWEN2,))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"], _PRE_LLAMA3),
    **dict.fromkeys(["dbrx", "smaug-bpe", "chatglm-bpe", "glm4"], PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"], _PRE_GPT2),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
        _PRE_DIGITS_GPT2,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"], _PRE_QWEN2),
    "falcon": PreTokenizer((r"[{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
}


def byte_to_unicode() -> list[str]:
    """GPT-2's table: byte value → the printable character that stands for it in the vocab."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    keep.update(range(ord("®"), ord("ÿ") + 1))
    table = [""] * 256
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE = byte_to_unicode()
UNICODE_TO_BYTE = {ch: b for b, ch in enumerate(BYTE_TO_UNICODE)}
# latin-1 decoding maps byte b to chr(b); translate then swaps in GPT-2's stand-ins.
_BYTE_TRANSLATE = {b: ch for b, ch in enumerate(BYTE_TO_UNICODE)}


def byte_encode(text: str) -> str:
    """UTF-8 bytes of `text` spelled with GPT-2's stand-in characters."""
    return text.encode("utf-8").decode("latin-1").translate(_BYTE_TRANSLATE)


def byte_decode(token_text: str) -> bytes:
    """Bytes a byte-level token stands for (characters outside the table pass through as UTF-8)."""
    try:
        return bytes(UNICODE_TO_BYTE[ch] for ch in token_text)
    except KeyError:
        out = bytearray()
        for ch in token_text:
            b = UNICODE_TO_BYTE.get(ch)
            out += ch.encode("utf-8") if b is None else bytes((b,))
        return bytes(out)


class BPEModel:
    """Pre-tokenizer + merge table over one vocabulary."""

    CACHE_SIZE = 65536

    def __init__(self, token_to_id: dict[str, int], merges: list[str], pre: PreTokenizer) -> None:
        self.token_to_id = token_to_id
        self.pre = pre
        self.regexes = [_expand(p) for p in pre.patterns]
        # Keyed by the merge's own text, "left right", the lowest rank of a repeated one winning.
        # llama.cpp splits a merge at its first space after the first character; the symbols merged
        # here are byte-level (no raw space is ever one of their characters), so `left + " " +
        # right` finds exactly the merges the pair (left, right) would, without two new strings and
        # a tuple per merge at load (SmolLM2's 49k merges: the tokenizer built in 84 ms instead of
        # 137, 5 MB less; Qwen3's 151k, three times that).
        self.ranks: dict[str, int] = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1), strict=True))
        self._cache: OrderedDict[str, list[int]] = OrderedDict()

    def split(self, text: str) -> list[str]:
        """Pre-tokenize: pieces of `text` (not yet byte-encoded)."""
        pieces = [text]
        for rx in self.regexes:
            out: list[str] = []
            for piece in pieces:
                pos = 0
                for m in rx.finditer(piece):
                    start, end = m.span()
                    if start > pos:
                        out.append(piece[pos:start])
                    out.append(piece[start:end])
                    pos = end
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of one raw-text fragment to `out`."""
        cache = self._cache
        for piece in self.split(text):
            word = byte_encode(piece)
            ids = cache.get(word)
            if ids is None:
                ids = self._merge(word)
                cache[word] = ids
                if len(cache) > self.CACHE_SIZE:
                    try:
                        cache.popitem(last=False)
                    except KeyError:  # emptied meanwhile by another thread
                        pass
            else:
                try:
                    cache.move_to_end(word)
                except KeyError:  # evicted meanwhile by an encode in another thread
                    pass
            out.extend(ids)

    def _merge(self, word: str) -> list[int]:
        vocab = self.token_to_id
        if self.pre.ignore_merges and word in vocab:
            return [vocab[word]]
        syms = list(word)
        ranks = self.ranks
        merge_pairs(syms, lambda a, b: ranks.get(a + " " + b))
        ids: list[int] = []
        for s in syms:
            if not s:
                continue
            tid = vocab.get(s)
            if tid is not None:
                ids.append(tid)
            else:  # not in the vocab (broken merges): one token per character, as llama.cpp
                ids.extend(vocab[ch] for ch in s if ch in vocab)
        return ids
