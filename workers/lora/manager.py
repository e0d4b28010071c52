"""A worker's adapters: the model's projections wrapped with LoRA slots, the adapters read into
host memory (``max_cpu_loras``, least recently used out), and, for each step, the adapters it
needs put in slots (``SlotTable``) and its tokens mapped to them.

Reading an adapter's files happens when a request that needs it joins the batch (a bad adapter
fails that request alone); writing a slot happens in the first step that needs the adapter
there. A step that needs no new adapter reads and writes nothing.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from shoal.bus.messages.lora import LoRARequest
from shoal.config.lora import LoRAConfig
from shoal.kernels.lora import NO_ADAPTER, build_mapping
from shoal.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from shoal.workers.lora.adapter import LoadedAdapter, load_adapter
from shoal.workers.lora.folders import AdapterFolders
from shoal.workers.lora.layers import (
    LoRAColumnLinear,
    LoRALayer,
    LoRALayers,
    LoRARowLinear,
    LoRAStepState,
)
from shoal.workers.lora.slots import SlotTable
from shoal.workers.models.decoder import DecoderForCausalLM

log = logging.getLogger(__name__)

# our fused projection -> the parts PEFT targets in it, in output order
WRAPPED = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


def wrap_lora_layers(
    model: DecoderForCausalLM,
    num_slots: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoRALayers:
    """Replace every targetable projection of ``model`` by its LoRA wrapper, in place."""
    wrapped = LoRALayers(state=LoRAStepState())
    for path, module in list(model.named_modules()):
        leaf = path.rsplit(".", 1)[-1]
        if leaf not in WRAPPED:
            continue
        parent = model.get_submodule(path.rsplit(".", 1)[0])
        layer: LoRALayer
        if isinstance(module, ColumnParallelLinear):
            layer = LoRAColumnLinear(
                module, list(module.shard_sizes), num_slots, max_rank, wrapped.state,
                dtype=dtype, device=device,
            )  # fmt: skip
        elif isinstance(module, RowParallelLinear):
            layer = LoRARowLinear(
                module, [None], num_slots, max_rank, wrapped.state, dtype=dtype, device=device
            )
        else:
            continue
        setattr(parent, leaf, layer)
        wrapped.layers[path] = layer
    return wrapped


class LoRAManager:
    def __init__(
        self,
        model: DecoderForCausalLM,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
        folders: AdapterFolders | None = None,
    ) -> None:
        self.model = model
        self.folders = folders or AdapterFolders()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.layers = wrap_lora_layers(model, config.max_loras, config.max_lora_rank, dtype, device)
        self.slots = SlotTable(config.max_loras)
        self._host: OrderedDict[int, LoadedAdapter] = OrderedDict()  # least recently used first
        self.num_reads = 0  # adapters read from their files
        self.num_slot_writes = 0  # adapters written into a slot

    @property
    def state(self) -> LoRAStepState:
        return self.layers.state

    def read(self, lora: LoRARequest) -> LoadedAdapter:
        """The adapter in host memory, read from its files unless it is there already."""
        adapter = self._host.get(lora.lora_int_id)
        if adapter is not None:
            self._host.move_to_end(lora.lora_int_id)
            return adapter
        adapter = load_adapter(
            self.folders.local(lora),
            lora.lora_int_id,
            self.model,
            self.layers,
            max_lora_rank=self.config.max_lora_rank,
            dtype=self.dtype,
        )
        self.num_reads += 1
        self._host[lora.lora_int_id] = adapter
        while len(self._host) > self.config.cpu_capacity:
            self._host.popitem(last=False)
        log.info(
            "LoRA adapter %r (id %d) read: %d B",
            lora.lora_name,
            lora.lora_int_id,
            adapter.num_bytes,
        )
        return adapter

    def prepare(self, loras: Sequence[LoRARequest | None], num_scheduled: np.ndarray) -> None:
        """Put the step's adapters in slots and map its tokens (``loras[i]``: the adapter of
        the i-th scheduled request, whose tokens number ``num_scheduled[i]``)."""
        needed = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if not needed:
            self.state.mapping = None
            return
        placement, writes = self.slots.place(needed)
        for adapter_id, slot in writes:
            adapter = self.read(needed[adapter_id])
            for path, layer in self.layers.layers.items():
                layer.load_slot(slot, adapter.modules.get(path, {}))
            self.num_slot_writes += 1
        request_slots = np.fromiter(
            (NO_ADAPTER if lora is None else placement[lora.lora_int_id] for lora in loras),
            np.int32,
            len(loras),
        )
        self.state.mapping = build_mapping(np.repeat(request_slots, num_scheduled), self.device)

    def end_step(self) -> None:
        self.state.mapping = None
