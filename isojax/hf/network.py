"""Whether the Hugging Face hub can be reached, decided once per process without waiting on
huggingface_hub's retry loop (which spends ~30 s backing off on a machine with no network)."""

from __future__ import annotations

import functools
import os
import socket


@functools.cache
def hub_reachable(host: str = "huggingface.co") -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False
