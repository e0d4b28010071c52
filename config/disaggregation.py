"""The disaggregated prefill group of the configuration (``DisaggregationConfig``, issue 33).

An engine core runs as ``disagg_role`` ``prefill`` (it only prefills requests whose decode runs
elsewhere, holding their KV for the decode side), ``decode`` (it takes every other request, and
pulls the KV of prompts prefilled elsewhere) or ``both`` (today's engine core: no handovers).
Local mode plans ``num_prefill`` prefill and ``num_decode`` decode engine cores (the data
parallel size is their sum). The engine client decides per request, as NVIDIA Dynamo's
conditional disaggregation does: a prompt whose uncached part is longer than
``max_local_prefill_length`` tokens is prefilled on a prefill engine core when one has at most
``max_prefill_queue_size`` requests waiting, else on the decode engine core itself.
"""

from __future__ import annotations

import msgspec

from shoal.config.validation import one_of, require

DISAGG_ROLES = ("both", "prefill", "decode")
# vLLM's --kv-transfer-config kv_role for each
VLLM_KV_ROLES = {"kv_both": "both", "kv_producer": "prefill", "kv_consumer": "decode"}


class DisaggregationConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Prefill and decode on separate engine cores; off (every core ``both``) by default."""

    disagg_role: str = "both"  # this engine core's (``shoal actor engine``)
    num_prefill: int = 0  # local mode: prefill engine cores (0: no disaggregation)
    num_decode: int = 0  # local mode: decode engine cores
    # Dynamo's defaults: prefill remotely past this many uncached prompt tokens...
    max_local_prefill_length: int = 1000
    # ...when the least loaded prefill engine core has at most this many requests waiting.
    max_prefill_queue_size: int = 2
    # How long a prefill engine core holds a prompt's KV nobody pulled (vLLM's
    # VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
    kv_handover_lease_s: float = 480.0
    # Where a prefill worker serves its KV cache to decode workers on other hosts ("": every
    # interface, advertised as this host's name resolved).
    kv_data_host: str = ""

    def __post_init__(self) -> None:
        one_of(self.disagg_role, DISAGG_ROLES, "disagg_role")
        require(self.num_prefill >= 0, "num_prefill", f"must be >= 0, got {self.num_prefill}")
        require(self.num_decode >= 0, "num_decode", f"must be >= 0, got {self.num_decode}")
        require(
            (self.num_prefill == 0) == (self.num_decode == 0),
            "num_prefill",
            f"and num_decode go together: got {self.num_prefill} and {self.num_decode}",
        )
        require(
            self.max_local_prefill_length >= 0,
            "max_local_prefill_length",
            f"must be >= 0, got {self.max_local_prefill_length}",
        )
        require(
            self.max_prefill_queue_size >= 0,
            "max_prefill_queue_size",
            f"must be >= 0, got {self.max_prefill_queue_size}",
        )
        require(
            self.kv_handover_lease_s > 0,
            "kv_handover_lease_s",
            f"must be positive, got {self.kv_handover_lease_s}",
        )

    @property
    def enabled(self) -> bool:
        """Whether any engine core of the deployment prefills for another."""
        return self.num_prefill > 0 or self.disagg_role != "both"

    def role_of(self, dp_rank: int) -> str:
        """The role of local mode's engine core ``dp_rank``: prefill first, then decode."""
        if self.num_prefill == 0:
            return self.disagg_role
        return "prefill" if dp_rank < self.num_prefill else "decode"
