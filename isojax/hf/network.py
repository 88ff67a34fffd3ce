"""Whether the Hugging Face hub can be reached, decided once per process without waiting on
huggingface_hub's retry loop (which spends ~30 s backing off on a machine with no network).

The hub is the one HF_ENDPOINT names (a mirror, a company's proxy), huggingface.co when unset:
its host is resolved and its port contacted (a short TCP connect), so a mirror reachable while
huggingface.co is not counts as reachable, and a mirror that is down does not. Once it is, every
request to it is bounded in time (HF_HUB_DOWNLOAD_TIMEOUT). Below: the hub's errors as one line
for the user, naming the file and the host where a file's download failed (an LFS file comes from
the address the hub redirects it to, a CDN), and which of them are worth another try."""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import unquote, urljoin, urlsplit

from isojax.errors import UserError

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
    _hook_client()
    return True


_REDIRECTED: dict[str, str] = {}  # where the hub sent a file's download (no query) -> the file's path in its repo


@functools.cache
def _hook_client() -> None:
    """huggingface_hub sends its API requests (repo info, refs, file lists) with no timeout, so a hub
    that takes the connection and never answers would hang a run for ever. Each request of its
    shared client that has none gets the timeout of a file's download instead
    (HF_HUB_DOWNLOAD_TIMEOUT, 10 s unless set: nothing received for that long); requests that set
    their own (file downloads, HEADs) keep theirs. And where the hub redirects a file (an LFS file's
    HEAD answers with its CDN address, fetched next) is noted, so an error there can name the file."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    def bound(request) -> None:  # an explicit timeout=None per request overrides a client's default
        limits = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {k: constants.HF_HUB_DOWNLOAD_TIMEOUT if limits.get(k) is None else limits[k]
                                         for k in ("connect", "read", "write", "pool")}

    def note_redirect(response) -> None:
        url = str(response.request.url).split("?")[0]
        if "/resolve/" in url and response.has_redirect_location:
            _REDIRECTED[urljoin(url, response.headers["Location"]).split("?")[0]] = _resolved_file(url)

    def client():
        c = _http.default_client_factory()
        c.event_hooks["request"] = [*c.event_hooks["request"], bound]
        c.event_hooks["response"] = [*c.event_hooks["response"], note_redirect]
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


# ---- the hub's errors, for the user ----------------------------------------------------------------

LOGIN_HINT = "log in with `hf auth login` (formerly `huggingface-cli login`) or set HF_TOKEN"


def hub_error(exc: Exception, repo_id: str, revision: str | None) -> UserError:
    from huggingface_hub import errors as e

    rev = revision or "main"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, e.RevisionNotFoundError):
        return UserError(f"revision {rev!r} not found in hub repo {repo_id}")
    if isinstance(exc, e.GatedRepoError):
        return UserError(f"hub repo {repo_id} is gated ({status or 'refused'}): accept its terms on its page "
                         f"and {LOGIN_HINT}")
    if isinstance(exc, e.RepositoryNotFoundError):
        return UserError(f"hub repo {repo_id} not found (if it is private or gated, {LOGIN_HINT})")
    if isinstance(exc, e.HfHubHTTPError) and status in (401, 403):
        return UserError(f"hub repo {repo_id}: access refused ({status}); {LOGIN_HINT}")
    url = _timeout(exc)
    if url is not None:
        from huggingface_hub import constants
        wait = f"{constants.HF_HUB_DOWNLOAD_TIMEOUT} s (HF_HUB_DOWNLOAD_TIMEOUT) in any of its tries; try again later"
        file = _file_of(url)
        if file:
            return UserError(f"cannot download {file} of {repo_id}@{rev}: {_host(url)} sent nothing of it for {wait}")
        return UserError(f"cannot download {repo_id}@{rev}: the hub at {hub_endpoint()} sent nothing of its API for "
                         f"{wait}")
    if isinstance(exc, e.LocalEntryNotFoundError):
        if hub_offline() or not hub_reachable():
            return UserError(f"{repo_id}@{rev} is not in the Hugging Face cache and {why_unreachable()}")
        cause = exc.__cause__ or exc.__context__
        reason = f"{type(cause).__name__}: {str(cause).splitlines()[0]}" if cause is not None and str(cause) else \
            str(exc).splitlines()[0]
        return UserError(f"cannot download {repo_id}@{rev} from {hub_endpoint()} ({reason[:200]}), "
                         "and it is not in the Hugging Face cache")
    url = _url_of(exc)
    what = f"{_file_of(url)} of {repo_id}@{rev} from {_host(url)}" if _file_of(url) else f"{repo_id}@{rev}"
    return UserError(f"cannot download {what}: {type(exc).__name__}: "
                     f"{str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "))


def status_of(exc: BaseException) -> int | None:
    """The HTTP status behind an error (or behind its cause)."""
    for e in (exc, exc.__cause__, exc.__context__):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status is not None:
            return status
    return None


def _resolved_file(url: str) -> str:
    """The file's path in its repo of a hub URL .../resolve/REVISION/PATH."""
    return unquote(url.split("/resolve/", 1)[1].split("/", 1)[-1])


def _file_of(url: str) -> str | None:
    """The repo file a request downloads: from the hub (/resolve/) or where the hub redirected it."""
    url = url.split("?")[0]
    return _resolved_file(url) if "/resolve/" in url else _REDIRECTED.get(url)


def _host(url: str) -> str:
    parts = urlsplit(url)
    return f"the hub at {hub_endpoint()}" if parts.netloc == urlsplit(hub_endpoint()).netloc else \
        f"{parts.scheme}://{parts.netloc} (where the hub sent its download)"


def _url_of(exc: BaseException) -> str:
    """The URL of the request behind exc (or behind its cause), '' where unknown."""
    for e in (exc, exc.__cause__, exc.__context__):
        for holder in (e, getattr(e, "response", None)):
            try:
                return str(holder.request.url)
            except (AttributeError, RuntimeError):  # httpx raises RuntimeError for an exception without one
                continue
    return ""


def _timeout(exc: BaseException) -> str | None:
    """The URL of a request behind exc that timed out ('' where unknown), or None."""
    for e in (exc, exc.__cause__, exc.__context__):
        if e is not None and type(e).__name__ in ("ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout"):
            try:
                return str(e.request.url).split("?")[0]
            except (AttributeError, RuntimeError):  # httpx raises RuntimeError for an exception without one
                return ""
    return None


def transient_api_error(exc: BaseException) -> bool:
    """A 5xx/408/429 (or a timeout, a refused connection) from the hub's API (/api/...), or a 5xx for
    a file's GET (huggingface_hub tries that once): worth another try. huggingface_hub falls back to
    the cache on these, raising LocalEntryNotFoundError with the HTTP error as its cause. A file
    whose download timed out or could not connect, on the hub or where the hub redirected it, is
    not: huggingface_hub's http_get tried it 6 times already (its resumes), its HEAD with backoff."""
    for e in (exc, exc.__cause__, exc.__context__):
        if e is None:
            continue
        status = status_of(e)
        request = getattr(getattr(e, "response", None), "request", None)
        url, method = str(getattr(request, "url", "") or ""), getattr(request, "method", "")
        # not a HEAD of a file: huggingface_hub retries those itself (5 times, ~25 s)
        if status is not None and (status >= 500 or status in (408, 429)) and ("/api/" in url or method == "GET"):
            return True
        if type(e).__name__ in ("ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException"):
            url = _url_of(e)
            return not url or "/api/" in urlsplit(url).path
    return False
