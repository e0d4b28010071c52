"""The adapter a request runs with (multi-LoRA serving, issue 34).

``LoRARequest`` is vLLM's: a name (what the request's ``model`` says), an integer id unique
within the deployment, and where the adapter's files are: a folder in PEFT's format on the
worker's host, or ``nats-object://NAME`` for an adapter pushed to the deployment's JetStream
object store (``shoal lora push``), which a worker on any host can fetch.
"""

from __future__ import annotations

import msgspec

OBJECT_STORE_SCHEME = "nats-object://"


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str = ""  # the model it adapts, as /v1/models names its parent

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}"
            )
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def in_object_store(self) -> bool:
        return self.lora_path.startswith(OBJECT_STORE_SCHEME)
