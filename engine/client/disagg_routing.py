"""Which requests are prefilled on a prefill engine core (disaggregated prefill, issue 33), as
NVIDIA Dynamo's conditional disaggregation decides: pure, over the router's view.

A request goes to its decode engine core (the router's pick among ``both``/``decode`` ones)
unless its prompt's part not cached there is longer than ``max_local_prefill_length`` tokens
and a ready prefill engine core has at most ``max_prefill_queue_size`` requests waiting (as
last reported, plus those this client sent since); then the best of those (its cached prefix
weighed with load in kv routing mode, else the least loaded) prefills it. Only plain requests
are disaggregated: one completion (``n`` 1) that may run past its first token.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from shoal.bus.messages.sampling import SamplingParams
from shoal.config.disaggregation import DisaggregationConfig
from shoal.engine.client.router import PREFILL_ROLES, EngineRouter, EngineView


class DisaggRouting:
    """The per-request decision, and how often it went each way."""

    def __init__(self, config: DisaggregationConfig, router: EngineRouter) -> None:
        self.enabled = config.enabled
        self.max_local_prefill_length = config.max_local_prefill_length
        self.max_prefill_queue_size = config.max_prefill_queue_size
        self.router = router
        self.num_remote = 0  # requests sent to a prefill engine core
        self.num_local = 0  # requests that could have been, prefilled on their decode core
        self._decode_engine_of: dict[str, str] = {}  # request → where it continues
        self.num_handed_over = 0  # requests continued on a decode engine core

    def prefill_engine(
        self,
        request_id: str,
        decode: EngineView,
        prompt_len: int,
        params: SamplingParams,
        block_hashes: Sequence[bytes] = (),
    ) -> EngineView | None:
        """The prefill engine core for a request bound for ``decode`` (None: prefill there);
        ``decode`` is remembered as where it continues (``decode_engine``)."""
        if not self.enabled or not disaggregable(params):
            return None
        cached = self.router.num_cached_blocks(decode.engine_id, block_hashes)
        uncached = prompt_len - cached * (decode.stats.block_size or 0)
        if uncached <= self.max_local_prefill_length:
            self.num_local += 1
            return None
        ready = [
            view
            for view in self.router.ready_engines(roles=PREFILL_ROLES)
            if view.stats.stats.num_waiting + view.num_sent_since_stats
            <= self.max_prefill_queue_size
        ]
        chosen = self.router.choose(ready, block_hashes)
        if chosen is None:
            self.num_local += 1
            return None
        self.num_remote += 1
        self._decode_engine_of[request_id] = decode.engine_id
        return chosen

    def decode_engine(self, request_id: str) -> EngineView | None:
        """Where a request prefilled remotely continues: the decode engine core chosen for it
        if it is still ready, else the router's pick now (None: no engine core is ready)."""
        wanted = self._decode_engine_of.pop(request_id, None)
        if wanted is not None and self.router.is_ready(wanted):
            engine: EngineView | None = self.router.engines[wanted]
        else:
            engine = self.router.pick()
        self.num_handed_over += engine is not None
        return engine

    def forget(self, request_id: str) -> None:
        """The request ended (or was aborted) before its handover."""
        self._decode_engine_of.pop(request_id, None)


def disaggregable(params: SamplingParams) -> bool:
    """One completion that may run past its first token."""
    return params.n == 1 and (params.max_tokens is None or params.max_tokens > 1)


def prefill_params(params: SamplingParams) -> SamplingParams:
    """A completion's parameters on its prefill engine core: its first token only."""
    return msgspec.structs.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def continued_params(params: SamplingParams) -> SamplingParams:
    """Its parameters on the decode engine core: its prompt's logprobs came with the first
    token (the decode side does not run the prompt)."""
    return msgspec.structs.replace(params, prompt_logprobs=None)
