"""The draft-model proposer against transformers: greedy drafts, KV rollback after partial
acceptance, chunked prompts, recomputation of a new request's prefix, the caps, seeded random
drafts and their distributions, and the checks on the draft checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.bus.messages.sampling import SamplingParams
from shoal.config.deployment import ShoalConfig
from shoal.workers.input_batch import InputBatch
from shoal.workers.request_store import RequestStore
from shoal.workers.spec_decode.draft_model import DraftModelProposer, draft_bytes_per_block
from shoal.workers.spec_decode.proposer import Drafts
from tests.fixtures.models import TINY_VOCAB, make_prompts

BLOCK = 4
K = 4
MAX_LEN = 64
NUM_BLOCKS = 96
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def dirs(tiny_checkpoint) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """(target, draft): the draft has one layer and other weights, the same vocabulary."""
    return tiny_checkpoint("llama"), tiny_checkpoint("llama", num_hidden_layers=1, seed=1)


def make_proposer(target: Path, draft: Path, max_model_len: int = MAX_LEN) -> DraftModelProposer:
    config = ShoalConfig.from_options(
        model=str(target),
        speculative_config={"model": str(draft), "num_speculative_tokens": K},
        max_num_seqs=4,
        block_size=BLOCK,
    )
    proposer = DraftModelProposer(
        config,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        max_model_len=max_model_len,
        vocab_size=TINY_VOCAB,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    proposer.load()
    return proposer


class Sim:
    """The runner's side, by hand: a persistent batch whose steps the proposer follows."""

    def __init__(self, proposer: DraftModelProposer, max_model_len: int = MAX_LEN) -> None:
        self.store = RequestStore(max_num_reqs=4, vocab_size=TINY_VOCAB)
        self.batch = InputBatch(self.store, max_model_len=max_model_len, block_size=BLOCK)
        self.proposer = proposer
        self.next_block = 1

    def blocks(self, n: int) -> list[int]:
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def add(
        self,
        req_id: str,
        prompt: list[int],
        *,
        computed: int = 0,
        blocks: list[int] | None = None,
        params: SamplingParams = GREEDY,
    ) -> int:
        blocks = self.blocks(MAX_LEN // BLOCK) if blocks is None else blocks
        row = self.batch.add_request(req_id, prompt, blocks, computed, params).row
        self.proposer.reset_row(row)
        return row

    def row(self, req_id: str) -> int:
        return self.store[req_id].row

    def step(self, scheduled: dict[str, int], sampled: dict[str, int], k: int = K) -> Drafts:
        """Run the scheduled tokens, append one sampled token to each of ``sampled`` (asked for
        drafts in that order), and propose."""
        inputs = self.batch.prepare_inputs(list(scheduled), list(scheduled.values()))
        self.batch.advance(inputs)
        rows = np.array([self.row(r) for r in sampled], dtype=np.int64)
        self.batch.append_token(rows, np.array(list(sampled.values()), dtype=np.int64))
        return self.proposer.propose(self.batch, inputs, rows, k)

    def verify(self, outcome: dict[str, tuple[list[int], int, int]]) -> Drafts:
        """A verification step: each request runs its last token and drafts, keeps the first
        ``accepted`` drafts plus one ``emitted`` token (as the runner rewrites the row), and
        is asked for new drafts."""
        batch = self.batch
        for req_id, (drafts, _, _) in outcome.items():
            row, n = self.row(req_id), int(batch.num_tokens[self.row(req_id)])
            batch.token_ids[row, n : n + len(drafts)] = drafts
            batch.num_tokens[row] = n + len(drafts)
        counts = [1 + len(drafts) for drafts, _, _ in outcome.values()]
        inputs = batch.prepare_inputs(list(outcome), counts)
        batch.advance(inputs)
        for req_id, (drafts, accepted, emitted) in outcome.items():
            row = self.row(req_id)
            n = int(batch.num_tokens[row]) - len(drafts)
            kept = [*drafts[:accepted], emitted]
            batch.token_ids[row, n : n + len(kept)] = kept
            batch.num_tokens[row] = n + len(kept)
            batch.num_computed[row] = n + len(kept) - 1
        rows = np.array([self.row(r) for r in outcome], dtype=np.int64)
        return self.proposer.propose(batch, inputs, rows, K)

    def tokens(self, req_id: str) -> list[int]:
        row = self.row(req_id)
        return self.batch.token_ids[row, : self.batch.num_tokens[row]].tolist()


def drafted(drafts: Drafts, i: int) -> list[int]:
    row = drafts.token_ids[i].tolist()
    assert all(t == -1 for t in row[drafts.num_drafts[i] :])
    return row[: drafts.num_drafts[i]]


def test_greedy_drafts_and_rollback_after_partial_acceptance(dirs, hf_reference):  # type: ignore[no-untyped-def]
    target, draft = dirs
    sim = Sim(make_proposer(target, draft))
    prompts = dict(zip("abc", make_prompts((5, 9, 13)), strict=True))
    for req_id, prompt in prompts.items():
        sim.add(req_id, prompt)
    order = {"c": 17, "a": 18, "b": 19}  # drafts come back in the order asked for
    first = sim.step({r: len(p) for r, p in prompts.items()}, order)
    expected = hf_reference(draft, [sim.tokens(r) for r in order], K)
    assert first.probs is None and first.num_drafts.tolist() == [K, K, K]
    assert [drafted(first, i) for i in range(3)] == expected

    got = {r: drafted(first, i) for i, r in enumerate(order)}
    # c accepts all (+ bonus), a accepts two (a different third token), b accepts none
    outcome = {
        "a": (got["a"], 2, (got["a"][2] + 1) % TINY_VOCAB),
        "b": (got["b"], 0, (got["b"][0] + 1) % TINY_VOCAB),
        "c": (got["c"], K, 42),
    }
    second = sim.verify(outcome)
    assert second.num_drafts.tolist() == [K, K, K]
    expected = hf_reference(draft, [sim.tokens(r) for r in outcome], K)
    assert [drafted(second, i) for i in range(3)] == expected


def test_chunked_prompt_proposes_nothing_and_catches_up(dirs, hf_reference):  # type: ignore[no-untyped-def]
    target, draft = dirs
    proposer = make_proposer(target, draft)
    sim = Sim(proposer)
    long_prompt, short_prompt = make_prompts((14, 5), seed=3)
    long_row = sim.add("long", long_prompt)
    sim.add("short", short_prompt)
    drafts = sim.step({"long": 6, "short": 5}, {"short": 30})
    assert drafts.token_ids.shape == (1, K)
    assert [drafted(drafts, 0)] == hf_reference(draft, [sim.tokens("short")], K)
    # the pending row's draft KV follows the target's computed tokens, and no further
    blocks = sim.batch.block_table[long_row]
    written = proposer.kv_cache.k[0][blocks[:4]].reshape(16, -1).abs().sum(dim=1) > 0
    assert written.tolist() == [True] * 6 + [False] * 10

    drafts = sim.step({"long": 8}, {"long": 31})
    assert [drafted(drafts, 0)] == hf_reference(draft, [sim.tokens("long")], K)


def test_new_request_recomputes_its_prefix_on_a_reused_row(dirs, hf_reference):  # type: ignore[no-untyped-def]
    """A prefix hit (or an offload load) gives the target KV the draft never wrote."""
    target, draft = dirs
    proposer = make_proposer(target, draft)
    sim = Sim(proposer)
    first, second = make_prompts((9, 12), seed=5)
    row = sim.add("old", first)
    sim.step({"old": 9}, {"old": 50})
    sim.batch.remove_request("old")
    hit = sim.blocks(2)
    torch.manual_seed(0)
    for cache in (*proposer.kv_cache.k, *proposer.kv_cache.v):
        cache[hit] = torch.randn_like(cache[hit]) * 5  # the draft's KV of those blocks: junk
    assert sim.add("new", second, computed=8, blocks=hit + sim.blocks(14)) == row
    drafts = sim.step({"new": 4}, {"new": 51})
    assert [drafted(drafts, 0)] == hf_reference(draft, [sim.tokens("new")], K)
    # one layer, 2 KV heads of 16 fp32 values, 4 positions a block, K and V
    per_block = draft_bytes_per_block(proposer.config, torch.float32)
    assert per_block == 2 * 4 * 2 * 16 * 4 == proposer.kv_cache.num_bytes // NUM_BLOCKS


def test_drafts_stop_at_max_model_len_and_at_the_block_table(dirs, hf_reference):  # type: ignore[no-untyped-def]
    target, draft = dirs
    sim = Sim(make_proposer(target, draft, max_model_len=24), max_model_len=24)
    edge, tight, blockless = make_prompts((21, 5, 8), seed=7)
    sim.add("edge", edge, blocks=sim.blocks(6))  # 22 tokens of 24: 2 drafts
    sim.add("tight", tight, blocks=sim.blocks(2))  # 6 tokens, KV room for 8: 3 drafts
    sim.add("blockless", blockless, blocks=sim.blocks(2))  # 9 tokens, no block for the 9th
    drafts = sim.step({"edge": 21, "tight": 5, "blockless": 8}, dict(edge=1, tight=2, blockless=3))
    assert drafts.num_drafts.tolist() == [2, 3, 0]
    full = hf_reference(draft, [sim.tokens("edge"), sim.tokens("tight")], K)
    assert [drafted(drafts, 0), drafted(drafts, 1)] == [full[0][:2], full[1][:3]]

    sim.batch.append_blocks(sim.row("blockless"), sim.blocks(2))  # the engine grows the table
    inputs = sim.batch.prepare_inputs(["blockless"], [1])
    row = np.array([sim.row("blockless")])
    drafts = sim.proposer.propose(sim.batch, inputs, row, K)
    assert [drafted(drafts, 0)] == hf_reference(draft, [sim.tokens("blockless")], K)
    with pytest.raises(ValueError, match="not scheduled"):
        sim.proposer.propose(sim.batch, inputs, np.array([sim.row("edge")]), K)


def hf_probs(model_dir: Path, tokens: list[list[int]], temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) at the last position of each sequence, by transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = [model(torch.tensor([t])).logits[0, -1] for t in tokens]
    return torch.softmax(torch.stack(logits) / temperature, dim=-1)


def test_seeded_random_drafts_are_reproducible_with_their_distributions(dirs, hf_reference):  # type: ignore[no-untyped-def]
    target, draft = dirs
    proposer = make_proposer(target, draft)
    prompt, greedy_prompt = make_prompts((7, 6), seed=9)

    def run(seed: int) -> tuple[Drafts, Sim]:
        sim = Sim(proposer)
        sim.add("r", prompt, params=SamplingParams(temperature=3.0, seed=seed))
        sim.add("g", greedy_prompt)
        return sim.step({"r": 7, "g": 6}, {"r": 60, "g": 61}), sim

    drafts, sim = run(7)
    again, _ = run(7)
    other, _ = run(8)
    assert drafts.probs is not None and again.probs is not None
    assert drafts.probs.shape == (2, K, TINY_VOCAB)
    assert np.array_equal(drafts.token_ids, again.token_ids)
    assert torch.equal(drafts.probs, again.probs)
    assert not np.array_equal(drafts.token_ids[0], other.token_ids[0])
    assert [drafted(drafts, 1)] == hf_reference(draft, [sim.tokens("g")], K)

    tokens = drafted(drafts, 0)
    probs = drafts.probs[0]
    assert torch.allclose(probs.sum(dim=-1), torch.ones(K), atol=1e-5)
    assert bool((probs[torch.arange(K), torch.tensor(tokens)] > 0).all())
    prefixes = [sim.tokens("r") + tokens[:j] for j in range(K)]
    assert torch.allclose(probs, hf_probs(draft, prefixes, 3.0), atol=1e-5)


def test_draft_checkpoint_must_fit_the_target(dirs, tiny_checkpoint):  # type: ignore[no-untyped-def]
    target, _ = dirs
    one_layer = {"num_hidden_layers": 1, "with_tokenizer": False}
    small_vocab = tiny_checkpoint("llama", vocab_size=256, **one_layer)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens but the target's has 320"):
        make_proposer(target, small_vocab)
    short = tiny_checkpoint("qwen2", max_position_embeddings=32, **one_layer)
    with pytest.raises(ValueError, match="at most 32 positions, below max_model_len=64"):
        make_proposer(target, short)


def test_a_long_catch_up_is_spread_over_steps_within_the_token_budget(dirs, hf_reference):  # type: ignore[no-untyped-def]
    """A prompt whose target KV came whole from the prefix cache: the draft catches up at most
    ``max_num_batched_tokens`` tokens a step, proposing nothing until it is level."""
    target, draft = dirs
    proposer = make_proposer(target, draft)
    proposer.max_catch_up_tokens = 8
    sim = Sim(proposer)
    (prompt,) = make_prompts((20,), seed=9)
    row = sim.add("r", prompt, computed=19)  # 19 positions hit; the last one runs
    inputs = sim.batch.prepare_inputs(["r"], [1])
    sim.batch.advance(inputs)
    sim.batch.append_token(np.array([row]), np.array([60]))
    rows = np.array([row], dtype=np.int64)
    caught_up = []
    for _ in range(3):
        drafts = proposer.propose(sim.batch, inputs, rows, K)
        caught_up.append(int(proposer.draft_computed[row]))
        if caught_up[-1] < 21:
            assert drafted(drafts, 0) == []
    assert caught_up[:2] == [8, 16]
    assert [drafted(drafts, 0)] == hf_reference(draft, [sim.tokens("r")], K)
