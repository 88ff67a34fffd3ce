"""Whether the Hugging Face hub can be reached, decided once per process without waiting on
huggingface_hub's retry loop (which spends ~30 s backing off on a machine with no network).

The hub is the one HF_ENDPOINT names (a mirror, a company's proxy), huggingface.co when unset:
its host is resolved and its port contacted (a short TCP connect), so a mirror reachable while
huggingface.co is not counts as reachable, and a mirror that is down does not."""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlsplit

DEFAULT_ENDPOINT = "https://huggingface.co"
CONNECT_TIMEOUT_S = 5.0


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: no request may leave the machine."""
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_reachable() -> bool:
    """Whether HF_ENDPOINT's host resolves and accepts a connection (False when offline). Every use
    of the hub asks this first, so the hub's answers are bounded in time from here on."""
    if hub_offline() or not _reachable(hub_endpoint()):
        return False
    _bound_api_timeouts()
    return True


@functools.cache
def _bound_api_timeouts() -> None:
    """huggingface_hub sends its API requests (repo info, refs, file lists) with no timeout, so a hub
    that takes the connection and never answers would hang a run for ever. Each request of its
    shared client that has none gets the timeout of a file's download instead
    (HF_HUB_DOWNLOAD_TIMEOUT, 10 s unless set: nothing received for that long); requests that set
    their own (file downloads, HEADs) keep theirs."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    def bound(request) -> None:  # an explicit timeout=None per request overrides a client's default
        limits = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {k: constants.HF_HUB_DOWNLOAD_TIMEOUT if limits.get(k) is None else limits[k]
                                         for k in ("connect", "read", "write", "pool")}

    def client():
        c = _http.default_client_factory()
        c.event_hooks["request"] = [*c.event_hooks["request"], bound]
        return c
    huggingface_hub.set_client_factory(client)


def why_unreachable() -> str:
    """A few words on why the hub is not used: offline mode, or no route to HF_ENDPOINT."""
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    return f"the hub at {hub_endpoint()} cannot be reached"


@functools.cache
def _reachable(endpoint: str) -> bool:
    url = urlsplit(endpoint)
    host = url.hostname
    if not host:
        return False
    try:
        port = url.port or (80 if url.scheme == "http" else 443)
    except ValueError:
        return False
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(CONNECT_TIMEOUT_S)
                s.connect(addr)
                return True
        except OSError:
            continue
    return False
