"""Codecs, and the wire layout of hot-path structs (schema evolution: fields are appended)."""

from __future__ import annotations

import msgspec
import pytest

from shoal.bus.codec import Codec, DecodeError, encode
from shoal.bus.messages.control import ActorState, ControlEvent, ErrorReply, Heartbeat
from shoal.bus.messages.engine import (
    AbortRequest,
    AddRequest,
    EngineCoreOutput,
    EngineInbound,
    EngineOutbound,
    EngineOutputs,
    EngineStats,
    KVTransferParams,
    Logprobs,
    ReleaseKV,
    RequestRejected,
    SchedulerStats,
)
from shoal.bus.messages.kv_handover import KVPull
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.offload import KVTransferResult, KVTransfers
from shoal.bus.messages.pooling import PoolingParams
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.messages.structured import GrammarBitmask
from shoal.bus.messages.worker import (
    CachedRequestData,
    ExecuteStep,
    NewRequestData,
    ResetWorker,
    StepError,
    StepResult,
    WorkerInbound,
)


def test_union_round_trip_dispatches_on_tag():
    codec = Codec(EngineInbound)
    add = AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4), "c1", 1.5)
    assert codec.decode(codec.encode(add)) == add
    assert codec.decode(encode(AbortRequest(["r1"]))) == AbortRequest(["r1"])
    assert codec.decode(encode(ReleaseKV(["r1"]))) == ReleaseKV(["r1"])
    remote = AddRequest(
        "r2", [1], SamplingParams(), "c1", 0.0, kv_transfer_params=KVTransferParams(True)
    )
    assert codec.decode(codec.encode(remote)) == remote


def test_decode_errors_are_readable_and_typed():
    codec = Codec(EngineInbound)
    with pytest.raises(DecodeError) as failure:
        codec.decode(b"\xc1")
    assert "cannot decode" in str(failure.value)
    with pytest.raises(DecodeError) as failure:
        codec.decode(encode(ResetWorker("x")))  # a tag this union does not have
    assert "reset" in str(failure.value)
    # a value that fails SamplingParams' own validation is a decode error too
    bad = AddRequest("r1", [1], SamplingParams(), "c1", 0.0)
    raw = msgspec.msgpack.decode(encode(bad))
    raw[3] = {"temperature": -1.0}
    with pytest.raises(DecodeError, match="temperature"):
        codec.decode(msgspec.msgpack.encode(raw))


# Field order of every array_like struct: encoded positionally, so a reorder or an insertion
# breaks peers running the previous version. New fields go at the END, with a default.
WIRE_LAYOUT: dict[type[msgspec.Struct], tuple[str, ...]] = {
    AddRequest: ("request_id", "prompt_token_ids", "sampling_params", "client_id",
                 "arrival_time", "eos_token_ids", "priority", "cache_salt"),
    AbortRequest: ("request_ids",),
    ReleaseKV: ("request_ids",),
    KVTransferParams: ("do_remote_decode", "remote_block_ids", "num_remote_tokens",
                       "do_remote_prefill", "remote_engine_id", "remote_kv", "lease_s"),
    KVPull: ("req_id", "block_ids", "remote_block_ids", "source"),
    LoRARequest: ("lora_name", "lora_int_id", "lora_path", "base_model_name"),
    PoolingParams: ("pooling_type", "normalize"),
    Logprobs: ("token_ids", "logprobs", "ranks"),
    EngineCoreOutput: ("request_id", "new_token_ids", "finish_reason", "stop_reason",
                    "new_logprobs", "prompt_logprobs", "num_cached_tokens", "error"),
    SchedulerStats: ("num_running", "num_waiting", "kv_usage", "prefix_cache_queries",
                     "prefix_cache_hits", "num_preemptions", "num_prompt_tokens",
                     "num_generation_tokens", "step_id"),
    EngineOutputs: ("engine_id", "outputs", "timestamp", "stats"),
    RequestRejected: ("request_id", "code", "message"),
    EngineStats: ("engine_id", "stats", "timestamp", "max_model_len", "num_blocks",
                  "block_size"),
    NewRequestData: ("req_id", "prompt_token_ids", "sampling_params", "block_ids",
                     "num_computed_tokens", "num_scheduled_tokens", "output_token_ids",
                     "resumed", "eos_token_ids"),
    CachedRequestData: ("req_id", "new_block_ids", "num_computed_tokens",
                        "num_scheduled_tokens", "num_spec_tokens"),
    ExecuteStep: ("step_id", "new_requests", "cached_requests", "finished_req_ids",
                  "preempted_req_ids"),
    GrammarBitmask: ("req_ids", "words", "data"),
    ResetWorker: ("reason",),
    StepError: ("message", "req_ids"),
    StepResult: ("step_id", "req_ids", "sampled_token_ids", "logprobs", "prompt_logprobs",
                 "error", "execute_time_s"),
    Heartbeat: ("actor_id", "kind", "seq", "state", "timestamp", "load"),
    ErrorReply: ("code", "message"),
    KVTransfers: ("region", "loads", "stores"),
    KVTransferResult: ("failed_load_req_ids", "failed_store_job_ids", "num_load_bytes",
                       "num_store_bytes", "load_time_s", "store_time_s"),
}  # fmt: skip


@pytest.mark.parametrize("struct", list(WIRE_LAYOUT), ids=lambda s: s.__name__)
def test_wire_layout_is_pinned(struct: type[msgspec.Struct]):
    fields = struct.__struct_fields__
    pinned = WIRE_LAYOUT[struct]
    assert fields[: len(pinned)] == pinned, f"{struct.__name__}: fields reordered or inserted"
    num_required = len(fields) - len(struct.__struct_defaults__)
    appended = fields[len(pinned) :]
    assert len(pinned) >= num_required, f"{appended} appended without defaults"


def test_wire_layout_covers_every_hot_path_struct():
    """Every ``gc=False`` array_like struct (the per-step hot path) must be pinned above."""
    import shoal.bus.messages.control as control
    import shoal.bus.messages.engine as engine
    import shoal.bus.messages.worker as worker

    hot_path = {
        obj
        for module in (control, engine, worker)
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, msgspec.Struct)
        and obj.__struct_config__.array_like
        and not obj.__struct_config__.gc
    }
    assert hot_path and hot_path <= set(WIRE_LAYOUT), hot_path - set(WIRE_LAYOUT)


def test_old_peer_decodes_message_with_appended_field():
    class StepResultNext(msgspec.Struct, tag="result", array_like=True, omit_defaults=True):
        step_id: int
        req_ids: list[str] = []
        sampled_token_ids: list[list[int]] = []
        logprobs: list[Logprobs | None] = []
        prompt_logprobs: list[Logprobs | None] = []
        error: StepError | None = None
        execute_time_s: float = 0.0
        future_field: int = 7

    new = StepResultNext(3, ["a"], [[5]], execute_time_s=0.5, future_field=9)
    old = Codec(StepResult).decode(encode(new))
    assert (old.step_id, old.req_ids, old.sampled_token_ids, old.execute_time_s) == (
        3, ["a"], [[5]], 0.5,
    )  # fmt: skip


def test_control_union_and_hot_path_round_trip():
    beat = Heartbeat("w0", "worker", 4, ActorState.READY, 12.5, {"kv": 0.5})
    assert Codec(ControlEvent).decode(encode(beat)) == beat
    step = ExecuteStep(
        9,
        [NewRequestData("r", [1, 2], SamplingParams(), [0], 0, 2)],
        [CachedRequestData("q", [4], 10, 1)],
    )
    assert Codec(WorkerInbound).decode(encode(step)) == step
    outputs = EngineOutputs("e0", [EngineCoreOutput("r", [3], "stop", 2)], 1.0)
    assert Codec(EngineOutbound).decode(encode(outputs)) == outputs
