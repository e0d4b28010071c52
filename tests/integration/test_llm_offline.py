"""The offline API (vLLM's shape) over a tiny model, in one process on the in-memory bus."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from shoal import LLM, SamplingParams
from shoal.engine.actor.core_actor import EngineCoreActor
from shoal.engine.core.engine_core import EngineCore
from tests.fixtures.models import hf_greedy, make_prompts
from tests.integration.conditions import (
    CONTEXT_LEN,
    assert_ended_by_abort,
    core_is_settled,
    pick_stop_string,
)

pytestmark = pytest.mark.timeout(180)
NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):  # type: ignore[no-untyped-def]
    engine = LLM(str(tiny_checkpoint("llama")), num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=16)
    yield engine
    engine.shutdown()


def test_generate_token_prompts_match_transformers(llm, tiny_checkpoint):  # type: ignore[no-untyped-def]
    prompts = make_prompts()
    expected = hf_greedy(tiny_checkpoint("llama"), prompts, 10)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in results] == expected
    assert all(r.outputs[0].finish_reason == "length" for r in results)
    assert [r.prompt_token_ids for r in results] == prompts


def test_generate_text_prompts_in_order_with_text(llm):  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = llm.generate(["hello", "the quick brown fox", "a"], params)
    assert len(results) == 3
    tokenizer = llm.get_tokenizer()
    for result in results:
        completion = result.outputs[0]
        assert len(completion.token_ids) == 5
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert results[1].prompt == "the quick brown fox"


def test_n_greater_than_one_and_seeds(llm):  # type: ignore[no-untyped-def]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    first = llm.generate("hello", params, use_tqdm=False)[0]
    again = llm.generate("hello", params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_chat_applies_a_template(llm):  # type: ignore[no-untyped-def]
    from shoal.engine.client.tokenizer import FALLBACK_CHAT_TEMPLATE, MissingChatTemplateError

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    messages = [{"role": "user", "content": "hi there"}]
    with pytest.raises(MissingChatTemplateError):
        llm.chat(messages, params)  # the tiny test tokenizer ships no template
    result = llm.chat(messages, params, use_tqdm=False, chat_template=FALLBACK_CHAT_TEMPLATE)[0]
    tokenizer = llm.get_tokenizer()
    rendered = "user: hi there\nassistant:"
    assert result.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert len(result.outputs[0].token_ids) == 4


def test_bad_arguments_are_clear_errors(tiny_checkpoint):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="model directory not found"):
        LLM("/nonexistent/model")
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(tiny_checkpoint("llama")), max_num_seqs=0)
    with pytest.raises(ValueError, match="NATS bus"):
        LLM(str(tiny_checkpoint("llama")), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_logit_bias_and_allowed_token_ids_offline(llm):  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[9, 33])
    biased = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={12: 100})
    prompts = [{"prompt_token_ids": [5, 6, 7]}] * 2
    restricted, pinned = llm.generate(prompts, [params, biased], use_tqdm=False)
    assert set(restricted.outputs[0].token_ids) <= {9, 33}
    assert pinned.outputs[0].token_ids == [12] * 6
    vocab = len(llm.get_tokenizer())
    with pytest.raises(ValueError, match=f"allowed_token_ids has token id {vocab}"):
        llm.generate("hello", SamplingParams(allowed_token_ids=[vocab]), use_tqdm=False)


EARLY_EOS_PROMPT = [60, 12, 186]  # greedy on the tiny llama: [274, 2] (eos second)


def _hf_generate(model_dir, prompt: list[int], **kwargs) -> list[int]:  # type: ignore[no-untyped-def]
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.eval().generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=3, **kwargs
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_min_tokens_masks_eos_as_transformers_min_new_tokens(llm, tiny_checkpoint, ignore_eos):  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    assert _hf_generate(model_dir, EARLY_EOS_PROMPT, max_new_tokens=8, eos_token_id=2) == [274, 2]
    want = _hf_generate(
        model_dir, EARLY_EOS_PROMPT, max_new_tokens=8, min_new_tokens=8, eos_token_id=2
    )
    assert len(want) == 8 and 2 not in want
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, ignore_eos=ignore_eos)
    result = llm.generate({"prompt_token_ids": EARLY_EOS_PROMPT}, params, use_tqdm=False)[0]
    assert result.outputs[0].token_ids == want
    assert result.outputs[0].finish_reason == "length"


def _engine_core(llm: LLM) -> EngineCore:
    (actor,) = [a for a in llm._actors if isinstance(a, EngineCoreActor)]
    assert actor.core is not None
    return actor.core


def _poll(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll from a plain thread, bounded; True once ``predicate`` holds. It reads the engine
    core while the loop thread changes it: a read that meets a change midway (a dict resized)
    is tried again."""
    deadline = time.monotonic() + timeout_s
    while not _holds(predicate):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _holds(predicate: Callable[[], bool]) -> bool:
    try:
        return predicate()
    except RuntimeError:  # "dictionary changed size during iteration"
        return False


def test_an_interrupted_generate_aborts_its_requests_in_the_engine_core(tiny_checkpoint):  # type: ignore[no-untyped-def]
    """Ctrl-C while ``generate`` waits: the requests (which could only end by abort: no eos,
    room for ~1000 tokens) are aborted in the engine core, not left running."""
    with LLM(str(tiny_checkpoint("llama")), num_gpu_blocks_override=NUM_BLOCKS) as llm:
        core = _engine_core(llm)
        prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9, 10]}]
        max_tokens = CONTEXT_LEN - 3
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

        def both_running() -> bool:
            return core.scheduler.num_running == 2 and core.stats().num_generation_tokens > 4

        def interrupt_once_both_run() -> None:
            # once both run, Ctrl-C; again (at most 5 times) if a second later both still run:
            # a signal that lands while the main thread runs a finalizer is swallowed there
            if not _poll(both_running, 60):
                return
            for _ in range(5):
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
                time.sleep(1.0)
                if not _holds(both_running):
                    return

        interrupter = threading.Thread(target=interrupt_once_both_run)
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params, use_tqdm=False)
        interrupter.join()
        assert _poll(lambda: core_is_settled(core), 120), "requests still in the core"
        stats = core.stats()
        assert_ended_by_abort(stats, num_blocks=NUM_BLOCKS, max_tokens=max_tokens, num_aborted=2)
        # The LLM still serves after the interrupt.
        short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        assert len(llm.generate(prompts[0], short, use_tqdm=False)[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_the_text_and_end_the_request_in_the_engine_core(llm, include):  # type: ignore[no-untyped-def]
    core = _engine_core(llm)
    prompt = "a long story"
    room = CONTEXT_LEN - len(llm.get_tokenizer().encode(prompt))
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
    stop = pick_stop_string(full)
    cut = full.index(stop) + (len(stop) if include else 0)
    assert _poll(lambda: core_is_settled(core), 30)
    before = core.stats()
    params = SamplingParams(
        temperature=0,
        max_tokens=room,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=include,
    )
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (full[:cut], "stop", stop)
    assert _poll(lambda: core_is_settled(core), 60), "the request is still in the core"
    after = core.stats()
    assert after.num_finished_abort == before.num_finished_abort + 1, after
    assert after.num_finished_length == before.num_finished_length, after
    assert after.num_generation_tokens - before.num_generation_tokens < room // 4, after
    assert after.num_free_blocks == NUM_BLOCKS - 1


def test_an_object_tier_serves_returning_prefixes_offline(tiny_checkpoint):  # type: ignore[no-untyped-def]
    """The offline ``LLM`` (in-memory bus) with an object tier behind a CPU tier too small for
    the conversations: the returning prefixes are promoted from the in-memory object store,
    and the greedy outputs equal transformers' (as with the tier off)."""
    from tests.integration.offload_workload import (
        BLOCK_SIZE,
        FIRST_TURNS,
        MAX_TOKENS,
        follow_up,
        offload_options,
    )

    model_dir = tiny_checkpoint("llama")
    obj_tier = {"type": "obj", "bytes_to_use": 64 << 20}
    options = offload_options(cpu_bytes=OFFLINE_CPU_BYTES, secondary_tiers=[obj_tier])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = LLM(str(model_dir), num_gpu_blocks_override=24, block_size=BLOCK_SIZE, **options)
    try:
        first = [_greedy_one(engine, prompt, params) for prompt in FIRST_TURNS]
        returning = [follow_up(i, answer) for i, answer in enumerate(first)]
        second = [_greedy_one(engine, prompt, params) for prompt in returning]
        (obj,) = [a for a in engine._actors if type(a).__name__ == "ObjTierActor"]
        loaded = obj.load()["num_chunks_loaded"]
    finally:
        engine.shutdown()
    assert first == hf_greedy(model_dir, list(FIRST_TURNS), MAX_TOKENS)
    assert second == hf_greedy(model_dir, returning, MAX_TOKENS)
    assert loaded >= 3 * 8, "the returning prefixes came from the object tier"


OFFLINE_CPU_BYTES = 12 * 8192  # twelve chunks of the tiny model: a conversation and a bit


def _greedy_one(engine: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    (result,) = engine.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return list(result.outputs[0].token_ids)


EXIT_SCRIPT = """
import concurrent.futures.thread as pools
import sys

from shoal import LLM, SamplingParams

llm = LLM(sys.argv[1], num_gpu_blocks_override=64, max_num_seqs=4)
shut_down = LLM.shutdown


def recorded(self):
    print("shutdown; thread pools open:", not pools._shutdown, flush=True)
    shut_down(self)


LLM.shutdown = recorded
llm.generate(["hello there"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
print("generated", flush=True)
"""


def test_a_script_that_never_shuts_down_still_stops_cleanly_at_exit(tiny_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    """The LLM is shut down as the interpreter starts to exit, while the workers' thread pools
    still take steps (a step in flight then ends normally instead of printing tracebacks)."""
    script = tmp_path / "ends_without_shutdown.py"
    script.write_text(EXIT_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(tiny_checkpoint("llama"))],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[-2:] == ["generated", "shutdown; thread pools open: True"]
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
