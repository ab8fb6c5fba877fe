"""SentencePiece-style tokenization (``tokenizer.ggml.model = llama``), as llama.cpp runs it.

The fragment's spaces become "▁" (U+2581); every character starts as its own symbol; then the
adjacent pair whose concatenation is a vocabulary token with the highest score is merged
(leftmost on ties) until no pair forms a token. A final symbol that is not a token is spelled
with byte-fallback tokens ``<0xNN>``, one per UTF-8 byte.
"""

from __future__ import annotations

from .tokenizer_merge import merge_pairs

SPACE_MARK = "\u2581"


class SPMModel:
    """Score-driven bigram merging over one vocabulary."""

    def __init__(self, token_to_id: dict[str, int], scores: list[float], byte_ids: list[int]) -> None:
        self.token_to_id = token_to_id
        self.scores = scores
        self.byte_ids = byte_ids
        """Token id for each byte value (``<0xNN>``, else the one-character token)."""

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of one raw-text fragment (space prefix already applied) to `out`."""
        if not text:
            return
        vocab = self.token_to_id
        scores = self.scores
        syms = list(text.replace(" ", SPACE_MARK))

        def priority(a: str, b: str) -> float | None:  # highest score first
            tid = vocab.get(a + b)
            return None if tid is None else -scores[tid]

        nxt = merge_pairs(syms, priority)
        byte_ids = self.byte_ids
        i = 0
        while i != -1:
            s = syms[i]
            tid = vocab.get(s)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(byte_ids[b] for b in s.encode("utf-8"))
            i = nxt[i]
