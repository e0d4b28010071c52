"""One completion as the engine client sees it: its tokens, text and logprobs so far, and what
was already sent (``OutputProcessor`` keeps one per engine-side request).

``CompletionState.update`` absorbs one step's output: tokens one at a time, incremental
detokenization, stop strings with hold-back (a match ends the completion and drops the step's
later tokens; the engine client then aborts it in the engine core), and logprob conversion.
``make_completion`` reports it in an output kind, advancing the sent marks for DELTA.
"""

from __future__ import annotations

from shoal.bus.messages.engine import EngineCoreOutput, Logprobs
from shoal.bus.messages.sampling import OutputKind, SamplingParams
from shoal.engine.client.detokenizer import IncrementalDetokenizer, make_detokenizer
from shoal.engine.client.outputs import CompletionOutput, Logprob, TokenLogprobs
from shoal.engine.client.stop_strings import StopStringMatcher
from shoal.engine.client.tokenizer import Tokenizer


def convert_logprobs(rows: Logprobs, tokenizer: Tokenizer | None) -> list[TokenLogprobs]:
    """Wire logprob rows → one ``{token_id: Logprob}`` dict per position.

    The actual token comes first with its own rank; the top-n candidates follow ranked 1..n.
    """
    converted: list[TokenLogprobs] = []
    for ids, logprobs, rank in zip(rows.token_ids, rows.logprobs, rows.ranks, strict=True):
        position: TokenLogprobs = {}
        for j, (token_id, logprob) in enumerate(zip(ids, logprobs, strict=True)):
            if token_id in position:
                continue
            text = tokenizer.token_text(token_id) if tokenizer is not None else None
            position[token_id] = Logprob(logprob, rank if j == 0 else j, text)
        converted.append(position)
    return converted


class CompletionState:
    """One engine-side request: its tokens, text, logprobs and what was already sent."""

    def __init__(
        self,
        index: int,
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        prompt_token_ids: list[int],
    ) -> None:
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer: IncrementalDetokenizer | None = None
        if params.detokenize and tokenizer is not None:
            self.detokenizer = make_detokenizer(
                tokenizer, prompt_token_ids, params.skip_special_tokens
            )
        self.matcher = StopStringMatcher(
            params.all_stop_strings if self.detokenizer else None,
            params.include_stop_str_in_output,
            params.min_tokens,
        )
        self._num_sent_tokens = 0
        self._num_sent_logprobs = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def has_news(self) -> bool:
        """Tokens not sent yet as a DELTA, or the end."""
        return self.finished or len(self.token_ids) > self._num_sent_tokens

    def update(self, output: EngineCoreOutput) -> bool:
        """Absorb one step's output; True when a stop string ended the completion here."""
        rows = convert_logprobs(output.new_logprobs, self.tokenizer) if output.new_logprobs else []
        stop_terminated = output.finish_reason == "stop"
        last = len(output.new_token_ids) - 1
        for k, token_id in enumerate(output.new_token_ids):
            self._append_token(token_id, rows[k] if k < len(rows) else None)
            # vLLM does not show the stop token (EOS or stop id) unless stop strings are kept.
            skip_text = stop_terminated and k == last and not self.params.include_stop_str_in_output
            text = (
                ""
                if skip_text or self.detokenizer is None
                else self.detokenizer.decode_next(token_id)
            )
            if self.matcher.append(text, len(self.token_ids)) is not None:
                self.finish_reason, self.stop_reason = "stop", self.matcher.matched
                return True  # later tokens of this step are dropped
        if output.finish_reason is not None:
            if self.detokenizer is not None:
                tail = self.detokenizer.flush()
                if tail and self.matcher.append(tail, len(self.token_ids)) is not None:
                    self.finish_reason, self.stop_reason = "stop", self.matcher.matched
                    return False  # the engine core has finished it already
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        return False

    def _append_token(self, token_id: int, row: TokenLogprobs | None) -> None:
        self.token_ids.append(token_id)
        if self.logprobs is None or row is None:
            return
        self.logprobs.append(row)
        if self.cumulative_logprob is not None and token_id in row:
            self.cumulative_logprob += row[token_id].logprob

    def make_completion(self, kind: OutputKind) -> CompletionOutput:
        """The completion as this output kind reports it; DELTA advances the sent marks."""
        finished = self.finished
        if kind == OutputKind.DELTA:
            text = self.matcher.next_delta(finished)
            token_ids = self.token_ids[self._num_sent_tokens :]
            logprobs = None if self.logprobs is None else self.logprobs[self._num_sent_logprobs :]
            self._num_sent_tokens = len(self.token_ids)
            self._num_sent_logprobs = len(self.logprobs or [])
        else:
            text = self.matcher.visible_text(finished)
            token_ids = list(self.token_ids)
            logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
