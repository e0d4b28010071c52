"""Where each adapter's files are on this host: a local folder as the request names it, or, for
an adapter in the deployment's object store (``nats-object://NAME``), the copy fetched into the
cache (``bus.folder_objects``). The worker actor fetches a step's adapters before the runner
reads them (``fetch_step_adapters``); only a step admitting a request whose adapter this host
has not fetched waits for it."""

from __future__ import annotations

from pathlib import Path

from shoal.bus.buckets import ObjectStore
from shoal.bus.folder_objects import fetch_folder
from shoal.bus.messages.lora import OBJECT_STORE_SCHEME, LoRARequest
from shoal.bus.messages.worker import ExecuteStep
from shoal.config.cache_root import default_cache_root
from shoal.config.peft_adapter import LoRAAdapterError


class AdapterFolders:
    def __init__(self, cache_root: Path | None = None) -> None:
        self.cache_root = cache_root or default_cache_root() / "lora"
        # (object path, adapter id) -> its local folder, or None: no such object
        self._fetched: dict[tuple[str, int], Path | None] = {}
        self.num_fetches = 0

    def local(self, lora: LoRARequest) -> Path:
        """The folder to read ``lora`` from (``LoRAAdapterError`` if an object-store adapter
        is missing from the store or was not fetched)."""
        if not lora.in_object_store:
            return Path(lora.lora_path)
        key = (lora.lora_path, lora.lora_int_id)
        if key not in self._fetched:
            raise LoRAAdapterError(f"{lora.lora_path}: not fetched from the object store")
        folder = self._fetched[key]
        if folder is None:
            raise LoRAAdapterError(
                f"{lora.lora_path}: no such adapter in the deployment's object store"
            )
        return folder

    def needs_fetch(self, lora: LoRARequest | None) -> bool:
        return (
            lora is not None
            and lora.in_object_store
            and (lora.lora_path, lora.lora_int_id) not in self._fetched
        )

    async def fetch(self, store: ObjectStore, lora: LoRARequest) -> None:
        name = lora.lora_path.removeprefix(OBJECT_STORE_SCHEME)
        folder = await fetch_folder(store, name, self.cache_root)
        self._fetched[(lora.lora_path, lora.lora_int_id)] = folder
        self.num_fetches += 1


def adapters_to_fetch(folders: AdapterFolders, step: ExecuteStep) -> list[LoRARequest]:
    """The object-store adapters of the step's new requests this host has not fetched."""
    wanted = {new.lora for new in step.new_requests if folders.needs_fetch(new.lora)}
    return [lora for lora in wanted if lora is not None]
