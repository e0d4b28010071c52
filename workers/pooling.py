"""Embeddings: a pooling request's prompt hidden states (the model's final normed states, before
the LM head) pooled into one vector, as the steps of its prefill compute them (a prompt may run
in several chunks): ``LAST`` keeps the last prompt token's state, ``CLS`` the first's, ``MEAN``
sums them all; once the prompt is done the vector is finished (divided, normalized) in fp32 and
returned with that step's result. The request itself then samples one token and ends."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shoal.bus.messages.pooling import PoolingParams
from shoal.workers.input_batch import StepInputs


@dataclass
class _Pooling:
    params: PoolingParams
    total: torch.Tensor | None = None  # MEAN's running sum; CLS's first state
    count: int = 0


class Pooler:
    def __init__(self) -> None:
        self._pools: dict[str, _Pooling] = {}

    def __bool__(self) -> bool:
        return bool(self._pools)

    def begin(self, req_id: str, params: PoolingParams) -> None:
        """A pooling request joins (again, after a preemption: from its first token)."""
        self._pools[req_id] = _Pooling(params)

    def forget(self, req_id: str) -> None:
        self._pools.pop(req_id, None)

    def pool(self, inputs: StepInputs, hidden: torch.Tensor) -> list[list[float] | None]:
        """Each scheduled request's embedding if this step finished its prompt (aligned with
        ``inputs.req_ids``; None for the others); empty when no pooling request ran."""
        if not any(req_id in self._pools for req_id in inputs.req_ids):
            return []
        bounds = inputs.query_start_loc
        out: list[list[float] | None] = []
        for i, req_id in enumerate(inputs.req_ids):
            pooling = self._pools.get(req_id)
            if pooling is None:
                out.append(None)
                continue
            rows = hidden[int(bounds[i]) : int(bounds[i + 1])].float()
            _accumulate(pooling, rows, first=int(inputs.num_computed[i]) == 0)
            done = bool(inputs.is_sampling[i])
            out.append(_finish(pooling, rows[-1]) if done else None)
        return out


def _accumulate(pooling: _Pooling, rows: torch.Tensor, *, first: bool) -> None:
    kind = pooling.params.pooling_type
    if kind == "MEAN":
        chunk = rows.sum(dim=0)
        pooling.total = chunk if pooling.total is None else pooling.total + chunk
        pooling.count += rows.shape[0]
    elif kind == "CLS" and first:
        pooling.total = rows[0].clone()


def _finish(pooling: _Pooling, last: torch.Tensor) -> list[float]:
    kind = pooling.params.pooling_type
    if kind == "LAST":
        vector = last
    else:
        assert pooling.total is not None, "a pooled prompt with no first chunk"
        vector = pooling.total / pooling.count if kind == "MEAN" else pooling.total
    if pooling.params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return np.asarray(vector.cpu(), dtype=np.float32).tolist()
