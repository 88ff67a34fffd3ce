"""A Hugging Face hub on 127.0.0.1 for the tests: the part of the Hub's HTTP API that the real
`huggingface_hub` and `datasets` clients use, serving repositories the tests build from folders.

    hub = LoopbackHub().start()
    hub.add_model("org/tiny", {"main": dir_a, "step0": dir_b})   # one folder per branch
    hub.add_dataset("org/pile", {"main": data_dir})
    hub.fail("resolve/.*model.safetensors", status=503, times=2)  # faults, per test
    hub.start_cdn()  # LFS files are redirected to a second server, as the Hub's are to its CDN
    os.environ["HF_ENDPOINT"] = hub.url
    ...
    hub.requests  # [(method, path, answered, status, arrived)] in the order answered (times: time.time())
    hub.stop()

Served (repo ids are `namespace/name`; revisions are branch names or the branch's commit):
- GET  /api/{models,datasets}/{repo}[/revision/{rev}]   info: id, sha, siblings, gated, private
- GET  /api/{models,datasets}/{repo}/refs                branches (tags, converts, PRs empty)
- GET  /api/{models,datasets}/{repo}/tree/{rev}[/{path}] entries (`recursive`), no pagination
- POST /api/{models,datasets}/{repo}/paths-info/{rev}    entries of the paths asked
- HEAD/GET /{repo}/resolve/{rev}/{path}, /datasets/{repo}/resolve/{rev}/{path}: the file, with
  X-Repo-Commit, ETag (git blob sha1 of a small file; sha256 of an "LFS" file, also as
  X-Linked-Etag / X-Linked-Size), Content-Length, Accept-Ranges and `Range: bytes=a-b` (206).
  With `start_cdn()`, an LFS file's HEAD and GET answer 302 (with the same X-Linked-* headers)
  to GET /lfs/{sha256} on a second server on 127.0.0.1 (another port: another origin, so the client
  neither follows the HEAD's redirect nor sends its token there), which serves the bytes with
  Content-Disposition naming the file; its requests go to `requests` too, and faults match its paths.
Faults: a status, a delay, a connection cut after some bytes, or flipped bytes (`corrupt`: one byte
of the body changed, the length kept); `Fault.hits` counts the requests a fault met (a stalled one
included, which `requests` lists only once answered).
Errors carry X-Error-Code as the Hub's do: RepoNotFound (401: the Hub does not say whether a repo
it hides exists), RevisionNotFound and EntryNotFound (404), GatedRepo (401 without a token, 403
with one not granted). Xet is never advertised, so the client downloads over plain HTTP.
"""

from __future__ import annotations

import dataclasses
import email.utils
import hashlib
import json
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".zst", ".gz", ".parquet", ".npz", ".msgpack", ".h5")


def commit_of(repo_id: str, branch: str, files: dict) -> str:
    """A fake 40-hex commit, stable for the same content."""
    h = hashlib.sha1(f"{repo_id}@{branch}".encode())
    for name in sorted(files):
        h.update(name.encode() + b"\0" + str(files[name].stat().st_size).encode())
    return h.hexdigest()


@dataclasses.dataclass
class Branch:
    name: str
    commit: str
    files: dict  # path in repo -> local Path


@dataclasses.dataclass
class Repo:
    kind: str  # "model" or "dataset"
    repo_id: str
    branches: dict  # name -> Branch
    gated: bool = False
    tokens: frozenset = frozenset()  # tokens granted access to a gated repo

    def branch(self, rev: str) -> Branch | None:
        if rev in self.branches:
            return self.branches[rev]
        return next((b for b in self.branches.values() if b.commit == rev), None)


@dataclasses.dataclass
class Fault:
    pattern: re.Pattern
    times: int  # how many more requests it hits (-1: every one)
    status: int | None = None  # answer this status instead
    drop_after: int | None = None  # send this many bytes of the body, then close the connection
    delay: float = 0.0  # wait this long before answering
    corrupt: bool = False  # send the body with its middle byte flipped (GET only)
    methods: tuple = ("GET", "HEAD", "POST")
    hits: int = 0


class LoopbackHub:
    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, float, int, float]] = []
        self._hashes: dict[Path, tuple[str, str]] = {}
        self._lfs: dict[str, Path] = {}  # sha256 -> file, for the CDN
        self._lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.cdn: ThreadingHTTPServer | None = None

    # --- repositories ---------------------------------------------------------------------
    def _add(self, kind: str, repo_id: str, branches: dict, gated: bool, tokens) -> Repo:
        out = {}
        for name, folder in branches.items():
            folder = Path(folder)
            files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
            out[name] = Branch(name, commit_of(repo_id, name, files), files)
        repo = Repo(kind, repo_id, out, gated, frozenset(tokens))
        self.repos[(kind, repo_id)] = repo
        return repo

    def add_model(self, repo_id: str, branches: dict, *, gated: bool = False, tokens=()) -> Repo:
        """branches: name -> folder whose files (recursively) are the branch's files."""
        return self._add("model", repo_id, branches, gated, tokens)

    def add_dataset(self, repo_id: str, branches: dict, *, gated: bool = False, tokens=()) -> Repo:
        return self._add("dataset", repo_id, branches, gated, tokens)

    # --- faults and records ---------------------------------------------------------------
    def fail(self, pattern: str, *, status: int | None = None, times: int = 1, drop_after: int | None = None,
             delay: float = 0.0, corrupt: bool = False, methods=("GET", "HEAD", "POST")) -> Fault:
        """The next `times` requests whose path matches `pattern` (re.search; -1: all of them)
        answer `status`, or are cut after `drop_after` bytes of the body, or get it with a byte
        flipped (`corrupt`), or wait `delay` s."""
        f = Fault(re.compile(pattern), times, status, drop_after, delay, corrupt, tuple(methods))
        self.faults.append(f)
        return f

    def _fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.times != 0 and method in f.methods and f.pattern.search(path):
                    if (f.drop_after is not None or f.corrupt) and method != "GET":
                        continue
                    f.times -= 1 if f.times > 0 else 0
                    f.hits += 1
                    return f
        return None

    def seen(self, pattern: str, method: str | None = None) -> list[tuple[str, str, float, int, float]]:
        """The requests served whose path matches `pattern` (re.search)."""
        rx = re.compile(pattern)
        return [r for r in list(self.requests) if rx.search(r[1]) and (method is None or r[0] == method)]

    def downloads(self, repo_id: str | None = None) -> list[str]:
        """Paths of the files whose bodies were sent (GET of resolve URLs)."""
        return [urllib.parse.unquote(r[1].split("?")[0]) for r in self.requests
                if r[0] == "GET" and "/resolve/" in r[1] and r[3] in (200, 206)
                and (repo_id is None or f"/{repo_id}/resolve/" in r[1])]

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> LoopbackHub:
        hub = self

        class Handler(_Handler):
            pass
        Handler.hub = hub
        self.server = self._serve(Handler, "loopback-hub")
        return self

    def start_cdn(self) -> LoopbackHub:
        """From now on LFS files are redirected to a second server (`cdn_url`), as the Hub's are."""
        class Handler(_Handler):
            pass
        Handler.hub, Handler.is_cdn = self, True
        self.cdn = self._serve(Handler, "loopback-cdn")
        return self

    @staticmethod
    def _serve(handler, name: str) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
        return server

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def cdn_url(self) -> str:
        host, port = self.cdn.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        for server in (self.server, self.cdn):
            if server is not None:
                server.shutdown()
                server.server_close()
        self.server = self.cdn = None

    def hashes(self, path: Path) -> tuple[str, str]:
        """(git blob sha1, sha256) of a file."""
        if path not in self._hashes:
            data = path.read_bytes()
            git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            self._hashes[path] = (git, hashlib.sha256(data).hexdigest())
        return self._hashes[path]

    def entry(self, path: str, local: Path) -> dict:
        size = local.stat().st_size
        git, sha256 = self.hashes(local)
        e = {"type": "file", "oid": git, "size": size, "path": path}
        if path.endswith(LFS_SUFFIXES):
            e["lfs"] = {"oid": sha256, "size": size, "pointerSize": 134}
        return e


class _Handler(BaseHTTPRequestHandler):
    hub: LoopbackHub
    is_cdn = False
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    # --- plumbing -------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, *, drop_after=None):
        self.send_response(status)
        headers = dict(headers or {})
        headers.setdefault("Content-Length", str(len(body)))
        headers.setdefault("Content-Type", "application/json" if body[:1] in (b"{", b"[") else "text/plain")
        for k, v in headers.items():
            self.send_header(k, v)
        if drop_after is not None:
            self.send_header("Connection", "close")
        self.end_headers()
        self.hub.requests.append((self.command, self.path, time.time(), status, self._arrived))
        if self.command == "HEAD":
            return
        if drop_after is not None:
            self.wfile.write(body[:drop_after])
            self.wfile.flush()
            self.close_connection = True
            try:
                import socket
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self.wfile.write(body)

    def _json(self, obj, status: int = 200, headers=None):
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, status: int, code: str | None, message: str):
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._json({"error": message}, status, headers)

    def do_HEAD(self):
        self._route()

    def do_GET(self):
        self._route()

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        self._body = self.rfile.read(n) if n else b""
        self._route()

    # --- routing --------------------------------------------------------------------------
    def _route(self):
        self._arrived = time.time()  # before an injected delay: when the client asked
        hub = self.hub
        parsed = urllib.parse.urlsplit(self.path)
        path, query = parsed.path, urllib.parse.parse_qs(parsed.query)
        fault = hub._fault(self.command, path)
        self._drop, self._corrupt = None, False
        if fault is not None:
            if fault.delay:
                time.sleep(fault.delay)
            if fault.status is not None:
                return self._error(fault.status, None, f"injected {fault.status}")
            self._drop, self._corrupt = fault.drop_after, fault.corrupt
        try:
            if self.is_cdn:
                m = re.fullmatch(r"/lfs/([0-9a-f]{64})", path)
                local = hub._lfs.get(m[1]) if m else None
                if local is None:
                    return self._error(404, None, f"loopback CDN: no blob at {path}")
                return self._file(local, {"ETag": f'"{m[1]}"', "Content-Disposition":
                                          f'attachment; filename="{local.name}"'})
            m = re.fullmatch(r"/api/(models|datasets)/([^/]+/[^/]+)(?:/(revision|refs|tree|paths-info)(?:/([^/]+))?(/.*)?)?", path)
            if m:
                kind = m[1][:-1]
                repo = self._repo(kind, m[2], auth=False)
                if repo is None:
                    return
                what, rev = m[3], urllib.parse.unquote(m[4] or "main")
                if what == "refs":
                    refs = [{"name": b.name, "ref": f"refs/heads/{b.name}", "targetCommit": b.commit}
                            for b in repo.branches.values()]
                    return self._json({"branches": refs, "tags": [], "converts": [], "pullRequests": []})
                branch = self._branch(repo, rev)
                if branch is None:
                    return
                if what in (None, "revision"):
                    return self._json({
                        "id": repo.repo_id, "_id": repo.repo_id, "sha": branch.commit, "private": False,
                        "gated": "manual" if repo.gated else False, "disabled": False, "downloads": 0, "likes": 0,
                        "lastModified": "2024-01-01T00:00:00.000Z", "createdAt": "2024-01-01T00:00:00.000Z",
                        "tags": [], "author": repo.repo_id.split("/")[0],
                        "siblings": [{"rfilename": p} for p in branch.files], "cardData": {},
                    })
                if what == "tree":
                    prefix = urllib.parse.unquote((m[5] or "").lstrip("/")).strip("/")
                    recursive = (query.get("recursive") or ["false"])[0].lower() in ("1", "true")
                    if prefix and not any(f.startswith(prefix + "/") for f in branch.files):
                        return self._error(404, "EntryNotFound", f"{prefix} does not exist on \"{rev}\"")
                    return self._json(self._tree(branch, prefix, recursive))
                if what == "paths-info":
                    form = urllib.parse.parse_qs(getattr(self, "_body", b"").decode())
                    try:
                        paths = form.get("paths") or json.loads(self._body or b"{}").get("paths", [])
                    except ValueError:
                        paths = []
                    out = []
                    for p in paths:
                        p = p.strip("/")
                        if p in branch.files:
                            out.append(hub.entry(p, branch.files[p]))
                        elif any(f.startswith(p + "/") for f in branch.files):
                            out.append({"type": "directory", "oid": "0" * 40, "path": p})
                    return self._json(out)
            m = re.fullmatch(r"/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                return self._resolve("dataset" if m[1] else "model", m[2], urllib.parse.unquote(m[3]),
                                     urllib.parse.unquote(m[4]))
            self._error(404, None, f"loopback hub: no route for {self.command} {path}")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _repo(self, kind: str, repo_id: str, auth: bool) -> Repo | None:
        repo = self.hub.repos.get((kind, repo_id))
        if repo is None:
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        if auth and repo.gated:
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
            if not token:
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to "
                                               "it and be authenticated to access it. Please log in.")
                return None
            if token not in repo.tokens:
                self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in the "
                                               "authorized list. Visit the repo page to ask for access.")
                return None
        return repo

    def _branch(self, repo: Repo, rev: str) -> Branch | None:
        branch = repo.branch(rev)
        if branch is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return branch

    def _tree(self, branch: Branch, prefix: str, recursive: bool) -> list:
        out, dirs = [], set()
        for p, local in branch.files.items():
            if prefix and not p.startswith(prefix + "/"):
                continue
            rest = p[len(prefix) + 1:] if prefix else p
            if "/" in rest:
                parts = rest.split("/")
                for i in range(1, len(parts) if recursive else 2):
                    d = "/".join(([prefix] if prefix else []) + parts[:i])
                    if d not in dirs:
                        dirs.add(d)
                        out.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0,
                                    "path": d})
                if not recursive:
                    continue
            out.append(self.hub.entry(p, local))
        return out

    def _resolve(self, kind: str, repo_id: str, rev: str, filename: str):
        repo = self._repo(kind, repo_id, auth=True)
        if repo is None:
            return
        branch = self._branch(repo, rev)
        if branch is None:
            return
        local = branch.files.get(filename)
        if local is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist on \"{rev}\"")
        git, sha256 = self.hub.hashes(local)
        headers = {"X-Repo-Commit": branch.commit}
        if filename.endswith(LFS_SUFFIXES):
            headers.update({"ETag": f'"{sha256}"', "X-Linked-Etag": f'"{sha256}"',
                            "X-Linked-Size": str(local.stat().st_size)})
            if self.hub.cdn is not None:
                self.hub._lfs[sha256] = local
                return self._send(302, b"", dict(headers, Location=f"{self.hub.cdn_url}/lfs/{sha256}"))
        else:
            headers["ETag"] = f'"{git}"'
        self._file(local, headers)

    def _file(self, local: Path, headers: dict):
        """A file's bytes, whole or the `Range` asked."""
        data = local.read_bytes()
        if self._corrupt:
            data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
        headers = dict(headers, **{"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                                   "Last-Modified": email.utils.formatdate(0, usegmt=True)})
        status, body = 200, data
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if m:
                size = len(data)
                if m[1] == "":
                    start, end = max(0, size - int(m[2])), size - 1
                else:
                    start, end = int(m[1]), min(size - 1, int(m[2])) if m[2] else size - 1
                if start >= size:
                    headers["Content-Range"] = f"bytes */{size}"
                    return self._send(416, b"", headers)
                status, body = 206, data[start:end + 1]
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        headers["Content-Length"] = str(len(body))
        self._send(status, body, headers, drop_after=self._drop)
