"""``XgrammarBackend``: the engine core's ``GrammarBackend`` (``engine/core/grammar.py``) on
xgrammar. Grammars compile on one thread of their own (the engine core's loop never waits for
one; xgrammar caches them, so a schema compiles once per engine core); matchers advance on the
loop as tokens land and fill one bitmask row each per step they sample in. The tokenizer is
loaded, and xgrammar imported, on the first request with a grammar.

A matcher that has accepted its stop token (terminated) leaves its row all ones: the request
ends on that token (unless it ignores EOS, when the rest of its output is free, as in vLLM).
Drafts (speculative decoding) are tried on the matcher and rolled back: it moves only by the
tokens that land."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from shoal.bus.messages.structured import GrammarBitmask, StructuredOutputsParams
from shoal.engine.core.grammar import GrammarState
from shoal.engine.structured.grammars import compile_grammar

if TYPE_CHECKING:
    import xgrammar

BITS_PER_WORD = 32


class XgrammarBackend:
    """Matchers by request id, for the tokenizer of ``tokenizer_dir`` and a model whose logits
    have ``vocab_size`` columns; ``stop_token_ids`` end a grammar (the model's EOS ids)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // BITS_PER_WORD)
        self._stop_token_ids = list(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._compiling: dict[str, Future[xgrammar.GrammarMatcher]] = {}
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}
        self._errors: dict[str, str] = {}

    def start(
        self, request_id: str, params: StructuredOutputsParams, output_token_ids: Sequence[int]
    ) -> None:
        outputs = list(output_token_ids)
        self._compiling[request_id] = self._pool.submit(self._matcher, params, outputs)

    def state(self, request_id: str) -> tuple[GrammarState, str]:
        if request_id in self._matchers:
            return GrammarState.READY, ""
        future = self._compiling.get(request_id)
        if future is None:
            return GrammarState.FAILED, self._errors.get(request_id, "no grammar was started")
        if not future.done():
            return GrammarState.COMPILING, ""
        del self._compiling[request_id]
        error = future.exception()
        if error is not None:
            self._errors[request_id] = message = f"grammar not compiled: {error}"
            return GrammarState.FAILED, message
        self._matchers[request_id] = future.result()
        return GrammarState.READY, ""

    def accept(self, request_id: str, token_ids: Sequence[int]) -> bool:
        matcher = self._matchers[request_id]
        return all(matcher.is_terminated() or matcher.accept_token(t) for t in token_ids)

    def valid_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        matcher = self._matchers[request_id]
        num_valid = 0
        for token_id in token_ids:
            if token_id < 0 or matcher.is_terminated() or not matcher.accept_token(token_id):
                break  # (a negative id is a placeholder draft, never valid)
            num_valid += 1
        if num_valid:
            matcher.rollback(num_valid)
        return num_valid

    def bitmask(
        self, request_ids: Sequence[str], drafts: Mapping[str, Sequence[int]]
    ) -> GrammarBitmask:
        row_ids = [rid for rid in request_ids for _ in range(len(drafts.get(rid, ())) + 1)]
        rows = np.full((len(row_ids), self.words), -1, dtype=np.int32)
        row = 0
        for request_id in request_ids:
            matcher = self._matchers[request_id]
            accepted, refused = 0, False
            for draft in [*drafts.get(request_id, ()), None]:
                if not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(rows, row)
                row += 1
                if draft is None or refused:
                    continue  # (rows after a refused draft are never used: it is rejected)
                refused = draft < 0 or not matcher.accept_token(draft)
                accepted += not refused
            if accepted:
                matcher.rollback(accepted)
        return GrammarBitmask(row_ids, self.words, rows.astype("<i4").tobytes())

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._errors.pop(request_id, None)
        future = self._compiling.pop(request_id, None)
        if future is not None:
            future.cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- on the compile thread -------------------------------------------------------------

    def _matcher(
        self, params: StructuredOutputsParams, output_token_ids: list[int]
    ) -> xgrammar.GrammarMatcher:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compile_grammar(self._get_compiler(), params))
        for token_id in output_token_ids:  # a request resumed with its output so far
            if not matcher.is_terminated() and not matcher.accept_token(token_id):
                raise ValueError("the request's output so far does not match its grammar")
        return matcher

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler
