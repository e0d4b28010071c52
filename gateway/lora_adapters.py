"""The LoRA adapters a gateway serves, by name (vLLM's ``--lora-modules`` and its run-time
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``): a request's ``model`` names the base
model or an adapter; ``/v1/models`` lists each adapter with the base model as its parent.

An adapter is a local folder in PEFT's format or ``nats-object://NAME``, pushed to the
deployment's object store (``shoal lora push``): then the gateway fetches it to check it, and
each worker fetches it by name, on any host. It is checked when it is added (its files
readable, its rank within ``--max-lora-rank``, only projections the model has as targets): a
bad one is a 400 naming the problem and serves nothing. Its id is derived from its name, path
and files (a local weights file's size and modification time; a fetched object's digest), so
every gateway of a deployment gives the same adapter the same id, and an adapter replaced gets a
new one (workers keep adapters by id).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.bus.buckets import ObjectStore
from shoal.bus.errors import BusError
from shoal.bus.folder_objects import fetch_folder
from shoal.bus.messages.lora import OBJECT_STORE_SCHEME, LoRARequest
from shoal.config.cache_root import default_cache_root
from shoal.config.lora import LoRAConfig
from shoal.config.peft_adapter import WEIGHTS_FILE, LoRAAdapterError, check_adapter
from shoal.gateway.errors import ApiError, bad_request
from shoal.gateway.response_types import ModelCard

OpenStore = Callable[[], Awaitable[ObjectStore]]


def adapter_id(name: str, path: str, folder: Path) -> int:
    """A positive 31-bit id, the same wherever the same files are added under the same name."""
    stamp = folder.name  # a fetched object's folder is named by its digest
    weights = folder / WEIGHTS_FILE
    if not path.startswith(OBJECT_STORE_SCHEME) and weights.is_file():
        info = weights.stat()
        stamp = f"{info.st_size}:{info.st_mtime_ns}"
    digest = hashlib.sha256(f"{name}\0{path}\0{stamp}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % (2**31 - 1) + 1


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404, f"The model `{model}` does not exist.", code="model_not_found", param="model"
    )


@dataclass
class LoRAAdapters:
    config: LoRAConfig = field(default_factory=LoRAConfig)
    base_model_name: str = ""
    num_layers: int | None = None  # the model's, to refuse adapters of layers it lacks
    open_store: OpenStore | None = None  # the deployment's adapter object store
    cache_root: Path = field(default_factory=lambda: default_cache_root() / "lora")
    _adapters: dict[str, tuple[LoRARequest, int]] = field(default_factory=dict)
    _store: ObjectStore | None = None

    @property
    def enabled(self) -> bool:
        return self.config.enable_lora

    async def load_modules(self) -> None:
        """Add ``--lora-modules`` (a bad one is a ``ValueError`` naming it)."""
        for module in self.config.lora_modules:
            try:
                await self.add(module.name, module.path, module.base_model_name)
            except ApiError as error:
                raise ValueError(f"--lora-modules {module.name}: {error.message}") from None

    def resolve(self, model: str | None, served_model_name: str) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for a name
        that is neither."""
        if model is None or model == served_model_name:
            return None
        entry = self._adapters.get(model)
        if entry is None:
            raise model_not_found(model)
        return entry[0]

    async def add(self, name: str, path: str, base_model_name: str = "") -> LoRARequest:
        if not self.enabled:
            raise bad_request("LoRA adapters are not enabled (start with --enable-lora)")
        if not name:
            raise bad_request("lora_name must not be empty", param="lora_name")
        if name in self._adapters:
            raise bad_request(
                f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        try:
            folder = await self._local_folder(path)
            check_adapter(
                folder, max_lora_rank=self.config.max_lora_rank, num_layers=self.num_layers
            )
        except LoRAAdapterError as exc:
            raise bad_request(f"LoRA adapter '{name}': {exc}", param="lora_path") from None
        lora = LoRARequest(
            name, adapter_id(name, path, folder), path, base_model_name or self.base_model_name
        )
        self._adapters[name] = (lora, int(time.time()))
        return lora

    async def _local_folder(self, path: str) -> Path:
        if not path.startswith(OBJECT_STORE_SCHEME):
            return Path(path)
        name = path.removeprefix(OBJECT_STORE_SCHEME)
        if self.open_store is None:
            raise LoRAAdapterError(f"{path}: this server has no object store to fetch it from")
        try:
            if self._store is None:
                self._store = await self.open_store()
            folder = await fetch_folder(self._store, name, self.cache_root)
        except (BusError, OSError, ValueError) as exc:
            raise LoRAAdapterError(f"{path}: not fetched from the object store ({exc})") from exc
        if folder is None:
            raise LoRAAdapterError(f"{path}: no such adapter in the deployment's object store")
        return folder

    def remove(self, name: str) -> LoRARequest:
        entry = self._adapters.pop(name, None)
        if entry is None:
            raise ApiError(
                404,
                f"The lora adapter '{name}' cannot be found.",
                code="not_found",
                param="lora_name",
            )
        return entry[0]

    def cards(self, max_model_len: int, served_model_name: str) -> list[ModelCard]:
        return [
            ModelCard(
                id=lora.lora_name,
                created=created,
                max_model_len=max_model_len,
                root=lora.lora_path,
                parent=lora.base_model_name or served_model_name,
            )
            for lora, created in self._adapters.values()
        ]
