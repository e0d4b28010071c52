"""The deployment's configuration: ``ShoalConfig`` and its groups (``deployment``), the KV
transfer (offload) group (``kv_transfer``), the speculative decoding group (``speculative``) and
their shared checks (``validation``). A leaf: msgspec structs importing nothing else of shoal,
read by every process and sent whole to actors started elsewhere."""
