"""SentencePiece-style tokenization (``tokenizer.ggml.model = llama``), as llama.cpp runs it.

The fragment's spaces become "▁" (U+2581); every character starts as its own symbol; then the
adjacent pair whose concatenation is a vocabulary token with the highest score is merged
(leftmost on ties) until no pair forms a token. A final symbol that is not a token is spelled
with byte-fallback tokens ``<0xNN>``, one per UTF-8 byte.
"""

from __future__ import annotations

import heapq

SPACE_MARK = "\u2581"


class SPMModel:
    """Score-driven bigram merging over one vocabulary."""

    def __init__(
        self, token_to_id: dict[str, int], scores: list[float], byte_ids: list[int]
    ) -> None:
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
        n = len(syms)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            tid = vocab.get(syms[i] + syms[i + 1])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            a, b = syms[left], syms[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # outdated: one side has been merged since
            merged = a + b
            syms[left] = merged
            syms[right] = ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
            before = prev[left]
            if before >= 0:
                cand = syms[before] + merged
                tid = vocab.get(cand)
                if tid is not None:
                    heapq.heappush(heap, (-scores[tid], before, left, len(cand)))
            if after >= 0:
                cand = merged + syms[after]
                tid = vocab.get(cand)
                if tid is not None:
                    heapq.heappush(heap, (-scores[tid], left, after, len(cand)))
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
