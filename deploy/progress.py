"""A progress bar for offline generation: prompts done, with input and output token rates."""

from __future__ import annotations

import time

from shoal.engine.client.outputs import RequestOutput


class ProgressBar:
    def __init__(self, total: int, *, enabled: bool = True, desc: str = "") -> None:
        self._bar = None
        self._started = time.perf_counter()
        self._num_prompt_tokens = 0
        self._num_output_tokens = 0
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True, unit="it")

    def update(self, output: RequestOutput | None) -> None:
        if self._bar is None or output is None:
            return
        self._num_prompt_tokens += len(output.prompt_token_ids)
        self._num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix_str(
            f"input: {self._num_prompt_tokens / elapsed:.1f} toks/s, "
            f"output: {self._num_output_tokens / elapsed:.1f} toks/s",
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
