"""LoRA affinity in the router, and what an engine core reports of its adapters: a request with
an adapter goes where the workers hold it (``lora_resident``) unless that engine core is busier
by more than ``LORA_AFFINITY`` requests (or, in kv mode, as many cached blocks); a request
without one, or with an adapter held nowhere, routes as before. The scheduler reports the
adapters running, waiting and resident (least recently used out, as the workers' slots), and the
gateway shows them as vLLM's ``vllm:lora_requests_info``."""

from __future__ import annotations

from shoal.bus.messages.engine import EngineStats, SchedulerStats
from shoal.bus.messages.kv_events import BlockStored, KVEventBatch
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import SamplingParams
from shoal.config.deployment import CacheConfig, SchedulerConfig
from shoal.config.lora import LoRAConfig
from shoal.engine.client.prefix_index import PrefixIndex
from shoal.engine.client.router import LORA_AFFINITY, EngineRouter
from shoal.engine.core.adapter_limit import ResidentAdapters
from shoal.engine.core.request import Request
from shoal.engine.core.scheduler import Scheduler
from shoal.gateway.metrics import Metrics


def stats(engine_id: str, load: int, resident: tuple[str, ...] = ()) -> EngineStats:
    scheduler = SchedulerStats(num_running=load, lora_resident=list(resident), max_loras=2)
    return EngineStats(engine_id, scheduler, 0.0)


def router_of(*engines: EngineStats, index: PrefixIndex | None = None) -> EngineRouter:
    router = EngineRouter(index=index)
    for engine in engines:
        router.on_stats(engine, now=0.0)
    return router


def picked(router: EngineRouter, lora_name: str | None, hashes: list[bytes] | None = None) -> str:
    view = router.pick(now=1.0, block_hashes=hashes or [], lora_name=lora_name)
    assert view is not None
    return view.engine_id


def picked_fresh(loads: tuple[int, int], lora_name: str | None) -> str:
    """The pick of a router that has heard e0 and e1 (e1 holding "sql") at these loads."""
    router = router_of(stats("e0", loads[0]), stats("e1", loads[1], resident=("sql",)))
    return picked(router, lora_name)


def test_an_adapter_goes_where_it_is_resident_unless_that_engine_is_much_busier() -> None:
    assert picked_fresh((0, 1), None) == "e0"  # by load alone
    assert picked_fresh((0, 1), "chat") == "e0"  # held nowhere: by load alone
    assert picked_fresh((0, 1), "sql") == "e1"  # held on e1: 1 - 2 beats 0
    assert picked_fresh((0, 0), "sql") == "e1"  # (a tie by load would go to e0)
    assert LORA_AFFINITY < 3
    assert picked_fresh((0, 3), "sql") == "e0"  # 3 - 2 loses to 0


def test_in_kv_mode_a_resident_adapter_weighs_as_cached_blocks() -> None:
    block = (1).to_bytes(4, "little")

    def pick(lora_name: str | None) -> str:
        index = PrefixIndex()
        router = router_of(stats("e0", 0), stats("e1", 0, resident=("sql",)), index=index)
        index.apply(KVEventBatch("e0", "a", 0, [BlockStored([block])]))
        return picked(router, lora_name, [block])

    assert pick(None) == "e0"  # one cached block
    assert pick("sql") == "e1"  # 2 (the adapter) beats 1 (the block)


def test_resident_adapters_follow_the_steps_least_recently_used_out() -> None:
    resident = ResidentAdapters(2)
    resident.note_step(["a", "b"])
    resident.note_step(["a"])
    resident.note_step(["c"])  # b was used least recently
    assert resident.names == ["a", "c"]


def test_the_scheduler_reports_its_adapters_and_the_gateway_shows_them() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
        CacheConfig(block_size=4),
        num_blocks=64,
        max_model_len=64,
        lora_config=LoRAConfig(enable_lora=True, max_loras=1),
    )
    params = SamplingParams(max_tokens=4)
    for i, name in enumerate(["sql", "chat"]):
        lora = LoRARequest(name, i + 1, f"/adapters/{name}")
        scheduler.add_request(Request(f"r{i}", [1, 2, 3], params, lora_request=lora))
    scheduler.schedule()
    report = scheduler.make_stats()
    assert (report.lora_running, report.lora_waiting) == (["sql"], ["chat"])
    assert (report.lora_resident, report.max_loras) == (["sql"], 1)
    metrics = Metrics("m", max_model_len=64)
    metrics.update_engine_stats(report, "e0")
    labels = {
        "model_name": "m",
        "engine": "e0",
        "max_lora": "1",
        "running_lora_adapters": "sql",
        "waiting_lora_adapters": "chat",
    }
    assert metrics.registry.get_sample_value("vllm:lora_requests_info", labels) > 0
    later = SchedulerStats(step_id=5, lora_running=["chat"], max_loras=1)
    metrics.update_engine_stats(later, "e0")  # the engine core's old series goes
    assert metrics.registry.get_sample_value("vllm:lora_requests_info", labels) is None
