"""Constrained decoding: grammars turned into token masks by llguidance, applied in the sampler.

Three parts, as the work splits:

- `Grammar`: what the output must match (a JSON schema, any JSON object, a llama.cpp GBNF or
  llguidance Lark grammar, a regex), tokenizer-independent, its syntax checked when made;
- `Constrainer`: one per vocabulary (cached on the Model as `model.constrainer`): llguidance's
  view of the GGUF vocabulary, built once (about a second for 262k tokens), and the place a
  grammar is checked against it and started;
- `Constraint`: one per generation: `fill` writes the allowed tokens as a bitmask (bit set =
  allowed, the layout llguidance and the device sampler share), `advance` feeds the chosen token,
  `done` says the grammar has finished.

The vocabulary reaches llguidance as the bytes each token decodes to (`Tokenizer.token_to_bytes`:
GPT-2 byte-level BPE already unmapped, SentencePiece "▁" as a space and ``<0xNN>`` as the byte).
Control and unknown tokens are special: they never match text, only a Lark grammar's
``<|name|>`` / ``<[id]>`` (`Constrainer.special_tokens`); user-defined tokens are text, as the
tokenizer matches them from text too (unlike llama.cpp's llguidance glue, which also makes
user-defined ``<...>`` tokens special): a literal ``"<tool_call>"`` then matches Qwen's single
user-defined token as well as the same text in pieces, and Gemma's thousands of user-defined
``<table>``-like tokens stay usable as text. The end-of-generation ids are llguidance's EOS set: the mask allows them only where the
grammar accepts, so a constrained generation ends when the grammar does or the model says so there.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import GrammarError
from .tokenizer import ATTR_CONTROL, ATTR_UNKNOWN, Tokenizer

if TYPE_CHECKING:
    import llguidance as llg
else:

    class _OnFirstUse:
        """llguidance, imported on first use (about 70 ms that a daemon's start does not need)."""

        def __getattr__(self, name: str) -> Any:
            import llguidance

            return getattr(llguidance, name)

    llg = _OnFirstUse()

JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,24}"
"""Whitespace allowed at one place in JSON output: up to 24 characters (a newline and nested
indentation), not llguidance's unbounded default, so a small model cannot pad forever. A schema's
own top-level ``"x-guidance"`` key overrides it."""


class _Worker:
    """One daemon thread running the calls submitted to it in order. (A ThreadPoolExecutor's
    threads are not daemon threads: once used, its idle thread held the daemon's exit until the
    shutdown bound forced it.)"""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """`fn(*args)` in the worker thread; the future holds its result or exception."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._jobs.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            fut, fn, args = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(exc)


_FILLER = _Worker("mask")
"""Where `Constraint.fill_async` computes masks (llguidance drops the GIL while it does)."""

SPECIAL_PREFIX = b"\xff"
"""llguidance's mark of a special token's bytes (no UTF-8 text starts with 0xFF)."""


def mask_words(n_vocab: int) -> int:
    """Length of the int32 bitmask of a vocabulary of `n_vocab` tokens."""
    return (n_vocab + 31) // 32


def _checked(spec: str) -> str:
    """`spec` when llguidance can compile it without a vocabulary, else GrammarError with its message."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(spec, None)
    if is_error:
        raise GrammarError(messages[0] if messages else "the grammar does not compile")
    return spec


@dataclass(frozen=True)
class Grammar:
    """What a constrained generation's output must match; make one with a class method."""

    kind: str
    """"json_schema", "json_object", "gbnf", "lark" or "regex"."""
    source: str
    """What the caller gave: the schema as JSON, or the grammar / regex text."""
    spec: str
    """llguidance's grammar (its JSON form), what a `Constrainer` starts."""

    @classmethod
    def json_schema(cls, schema: dict[str, Any], strict: bool = True) -> Grammar:
        """Output is a JSON instance of `schema`. `strict`: a keyword llguidance does not implement
        is an error (else it is ignored, llguidance's `lenient`); properties come in the schema's order."""
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
        options: Any = {"whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}
        try:
            source = json.dumps(schema)
            spec = llg.LLMatcher.grammar_from_json_schema(source, defaults=options)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"not a JSON schema: {exc}") from None
        return cls("json_schema", source, _checked(spec))

    @classmethod
    def json_object(cls) -> Grammar:
        """Output is one JSON object (any keys and values): OpenAI's ``json_object`` mode."""
        grammar = cls.json_schema({"type": "object"})
        return cls("json_object", "", grammar.spec)

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        """Output matches a llama.cpp GBNF grammar (``root ::= ...``), converted to Lark by
        llguidance's own converter (a grammar already in Lark syntax is taken as it is)."""
        try:
            spec = llg.grammar_from("gbnf", text)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        return cls("gbnf", text, _checked(spec))

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """Output matches an llguidance Lark grammar (``start: ...``; may embed ``%json { schema }``)."""
        return cls("lark", text, _checked(llg.LLMatcher.grammar_from_lark(text)))

    @classmethod
    def regex(cls, text: str) -> Grammar:
        """Output matches the regular expression `text` whole (Rust regex syntax, no lookaround)."""
        return cls("regex", text, _checked(llg.LLMatcher.grammar_from_regex(text)))


class Constraint:
    """One generation's grammar state: the mask of allowed next tokens, advanced token by token."""

    def __init__(self, matcher: llg.LLMatcher, n_vocab: int) -> None:
        self._matcher = matcher
        self.n_vocab = n_vocab
        """Width of the logits row the mask covers."""
        self.words = mask_words(n_vocab)
        """Length of the int32 bitmask."""
        self.mask_s = 0.0
        """Seconds spent computing masks so far (`fill`)."""
        self.masks = 0
        """Masks computed so far."""
        self.mask = np.zeros(self.words, dtype=np.int32)
        """A buffer of the mask's shape for `fill` (the host sampling path fills this one)."""

    def fill(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into `out` (int32 [(n_vocab + 31) // 32], C-contiguous;
        bit t % 32 of word t // 32 set = token t allowed)."""
        if out.dtype != np.int32 or out.size != self.words or not out.flags.c_contiguous:
            raise ValueError(f"the mask must be a contiguous int32 array of {self.words} words")
        t0 = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())

    def fill_async(self, out: np.ndarray) -> Future[None]:
        """`fill` in a worker thread, so the mask is computed while the caller runs the step's
        forward pass; the future's `result()` waits for it (and raises what `fill` raised)."""
        return _FILLER.submit(self.fill, out)

    def advance(self, token: int) -> None:
        """Feed the token chosen (from the mask `fill` gave); GrammarError if the grammar refuses it."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(self._matcher.get_error() or f"token {token} does not match the grammar")

    @property
    def done(self) -> bool:
        """The grammar has finished: nothing but an end-of-generation token may follow."""
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (the generation may end here)."""
        return bool(self._matcher.is_accepting())


class Constrainer:
    """llguidance's view of one vocabulary: checks grammars against it and starts `Constraint`s.

    The vocabulary is built on first use (thread-safe) and kept; `n_vocab` is the logits width,
    which may exceed the tokenizer's (padded output rows: never allowed).
    """

    def __init__(self, tokenizer: Tokenizer, n_vocab: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = max(int(n_vocab or 0), tokenizer.n_vocab)
        self._lock = threading.Lock()
        self._ll: llg.LLTokenizer | None = None

    @property
    def special_tokens(self) -> frozenset[str]:
        """Texts of the special (control and unknown) tokens: a grammar names these as tokens
        (Lark ``<|im_end|>``), a string literal never matches them (`ToolSyntax.grammar`'s `special`)."""
        tok = self.tokenizer
        mark = ATTR_CONTROL | ATTR_UNKNOWN
        return frozenset(t for t, a in zip(tok.tokens, tok.attrs, strict=True) if a & mark and t)

    @property
    def ll_tokenizer(self) -> llg.LLTokenizer:
        """The llguidance tokenizer (built on first use: about a second for a 262k vocabulary)."""
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self.tokenizer, self.n_vocab)
            return self._ll

    def check(self, grammar: Grammar) -> None:
        """GrammarError with llguidance's message when `grammar` does not compile against this
        vocabulary (e.g. a Lark grammar naming a special token the model lacks)."""
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar.spec, self.ll_tokenizer)
        if is_error:
            raise GrammarError(messages[0] if messages else "the grammar does not compile")

    def start(self, grammar: Grammar) -> Constraint:
        """A fresh `Constraint` for one generation (GrammarError as `check`)."""
        matcher = llg.LLMatcher(self.ll_tokenizer, grammar.spec, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher, self.n_vocab)


class _Vocabulary:
    """What `llguidance.TokenizerWrapper` reads: token bytes, special ids, and a tokenize callback."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int) -> None:
        self._tok = tokenizer
        special = ATTR_CONTROL | ATTR_UNKNOWN
        tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(tokenizer.n_vocab):
            piece = tokenizer.token_to_bytes(i)
            if tokenizer.attrs[i] & special:
                piece = SPECIAL_PREFIX + piece
                self.special_token_ids.append(i)
            tokens.append(piece)
        tokens += [b""] * (n_vocab - len(tokens))
        self.tokens = tokens
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids, default=0)
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, text: bytes | str) -> list[int]:
        """Ids of `text` as the tokenizer splits it inside a generation: no BOS, no space prefix."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        tok = self._tok
        out: list[int] = []
        for frag in tok._partition(text, False) if text else []:
            if isinstance(frag, int):
                out.append(frag)
            else:
                tok.model.encode(frag, out)
        return out


def _ll_tokenizer(tokenizer: Tokenizer, n_vocab: int) -> llg.LLTokenizer:
    vocab = _Vocabulary(tokenizer, n_vocab)
    eog = sorted(tokenizer.eog_ids) or [vocab.eos_token_id]
    return llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=n_vocab, eos_token=eog)
