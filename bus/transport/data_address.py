"""Where a direct data path (a TCP stream beside the bus: the p2p tier's, a prefill worker's
KV cache) listens and what address it gives its peers."""

from __future__ import annotations

import contextlib
import socket


def data_address(data_host: str) -> tuple[str, str]:
    """(bind host, advertised host): ``data_host`` for both, or (""), every interface and this
    host's name resolved (loopback when it does not resolve)."""
    if data_host:
        return data_host, data_host
    with contextlib.suppress(OSError):
        return "0.0.0.0", socket.gethostbyname(socket.gethostname())
    return "0.0.0.0", "127.0.0.1"
