"""Speculative decoding in the pure scheduler, edge cases a review found: a step that proposes no
drafts leaves none to verify; a draft model's lookahead never starves a request that fills the
cache."""

from __future__ import annotations

from shoal.config.speculative import SpeculativeConfig
from tests.unit.factories import Pipeline, make_requests, make_scheduler
from tests.unit.spec_fakes import FakeSpecWorker


def ngram(k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=k)


def test_no_drafts_proposed_means_none_verified() -> None:
    """Sync scheduling: a step whose result proposes no drafts leaves the K placeholders of
    ``after_schedule`` on every request, so each next step schedules K padded drafts."""
    scheduler = make_scheduler(speculative_config=ngram(3))
    for request in make_requests(2, 6, max_tokens=8):
        scheduler.add_request(request)
    worker = FakeSpecWorker(scheduler.block_size, lambda request_id, position: None)
    pipeline = Pipeline(scheduler, worker, 1)
    pipeline.run()
    stats = scheduler.make_stats()
    assert worker.num_verified == 0
    assert stats.spec_decode_num_draft_tokens == 0


def test_draft_model_lookahead_fits_a_request_that_fills_the_cache() -> None:
    """``check_fits`` admits a request whose prompt + max_tokens fill the whole cache, but the
    draft model's lookahead slots are not bounded by prompt + max_tokens: near its end a lone
    request cannot get its slots, preempts itself, and never runs again."""
    spec = SpeculativeConfig(
        speculative_method="draft_model", num_speculative_tokens=2, speculative_model="/draft"
    )
    scheduler = make_scheduler(speculative_config=spec, num_blocks=5)  # 16 usable slots
    (request,) = make_requests(1, 8, max_tokens=8)
    scheduler.add_request(request)  # accepted: 8 + 8 tokens fit exactly
    pipeline = Pipeline(scheduler, FakeSpecWorker(scheduler.block_size), 1)
    pipeline.run(max_steps=200)
    assert len(pipeline.outputs[request.request_id]) > 0
