"""Google Cloud Storage for --out, checkpoints and --data: the few operations isojax needs on a
gs://bucket/path URL, through fsspec's GCS driver (gcsfs). Local paths never come here.

A GCS "folder" is a prefix: it exists while an object lies under it. One object is written by one
upload and appears whole or not at all (there is no rename, no append, no lock, but an upload or a
delete can be made conditional on the object's generation): the rules built on that are
isojax.run.remote_out (results, and the lock on --out: an object created only where none is) and
isojax.device.checkpoints (a step's meta.json uploaded last).

Credentials come from the environment as Google's libraries read them: GOOGLE_APPLICATION_CREDENTIALS,
else gcloud's application-default credentials or the metadata server (google.auth.default);
with STORAGE_EMULATOR_HOST set (a local emulator) and no GOOGLE_APPLICATION_CREDENTIALS,
anonymous requests to that endpoint. No credential is ever logged or written: errors name the URL
and the kind of failure only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from isojax.errors import UserError

SCHEME = "gs://"


def is_remote(path) -> bool:
    return str(path).startswith(SCHEME)


class GsPath:
    """A gs://bucket/path URL with the Path operations isojax applies to --out: `/`, name, exists."""

    def __init__(self, url: str):
        if not is_remote(url) or not url[len(SCHEME):].split("/", 1)[0]:
            raise UserError(f"{url}: expected gs://BUCKET[/PATH]")
        self.url = url.rstrip("/")

    def __truediv__(self, rel) -> GsPath:
        return GsPath(f"{self.url}/{str(rel).strip('/')}")

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"GsPath({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, GsPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def bucket(self) -> str:
        return self.url[len(SCHEME):].split("/", 1)[0]

    @property
    def key(self) -> str:
        """bucket/path, as gcsfs names it."""
        return self.url[len(SCHEME):]

    def exists(self) -> bool:
        """An object of this name, or any object under it (a folder)."""
        return _call(self, lambda fs: fs.exists(self.key) or bool(fs.find(self.key, maxdepth=1)))


def path(p):
    """A GsPath for a gs:// URL, else a Path."""
    return p if isinstance(p, GsPath) else GsPath(str(p)) if is_remote(p) else Path(p)


def local_only(args, command: str) -> None:
    """Refuse gs:// in any argument of a command that reads and writes local folders only."""
    for value in vars(args).values():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if is_remote(v):
                raise UserError(f"{command} reads and writes local folders only, not {v}; copy the results "
                                "there first (gsutil -m cp -r, gcloud storage cp -r)")


# ---- the connection -------------------------------------------------------------------------------

@functools.cache
def _fs():
    try:
        import gcsfs.core  # the plain JSON API client (gcsfs's default class probes buckets over gRPC first)
    except ImportError:
        raise UserError("gs:// paths need gcsfs: pip install 'isojax[gcs]'") from None

    if "GCSFS_DEBUG" not in os.environ:  # its tracebacks on stderr: isojax says what failed in one line
        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    return gcsfs.core.GCSFileSystem(token=_credentials(), skip_instance_cache=True, use_listings_cache=False)


def _credentials():
    if os.environ.get("STORAGE_EMULATOR_HOST") and not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return "anon"
    import google.auth
    import google.auth.exceptions

    try:
        credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
    except google.auth.exceptions.DefaultCredentialsError as e:
        raise UserError(f"gs://: no Google credentials ({_first_line(e)}); set GOOGLE_APPLICATION_CREDENTIALS "
                        "to a service account's key file or run `gcloud auth application-default login`") from None
    return credentials


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def _call(where: GsPath, fn):
    """fn(filesystem), its failures as one line naming `where` (never a credential)."""
    fs = _fs()  # first: without gcsfs or credentials, that is the error
    import google.auth.exceptions
    from gcsfs.retry import HttpError

    try:
        return fn(fs)
    except FileNotFoundError:
        raise
    except google.auth.exceptions.GoogleAuthError as e:
        raise UserError(f"{where}: Google credentials refused ({type(e).__name__}); check "
                        "GOOGLE_APPLICATION_CREDENTIALS") from None
    except (OSError, HttpError, ValueError) as e:  # gcsfs: HTTP status (HttpError), bad request (ValueError)
        raise UserError(f"{where}: {_first_line(e)}") from None


def check(url: GsPath) -> None:
    """Before any work: credentials found and accepted, the bucket there."""
    url = path(url)
    try:
        _call(url, lambda fs: fs.find(url.key, maxdepth=1))  # object permissions suffice (no bucket metadata)
    except FileNotFoundError:
        raise UserError(f"{url}: no bucket {url.bucket!r} (or no access to it); create it or fix the URL") from None


# ---- objects ------------------------------------------------------------------------------------

def read_bytes(url: GsPath) -> bytes:
    url = path(url)
    return _call(url, lambda fs: fs.cat_file(url.key))


def write_bytes(url: GsPath, data: bytes | str) -> None:
    """One upload: the object is replaced whole or not at all."""
    url = path(url)
    data = data.encode() if isinstance(data, str) else data
    _call(url, lambda fs: fs.pipe_file(url.key, data))


def create_bytes(url: GsPath, data: bytes | str) -> bool:
    """One upload made only where no object of that name is there (the precondition
    ifGenerationMatch=0, checked by GCS itself): True, or False where one is."""
    url = path(url)
    data = data.encode() if isinstance(data, str) else data

    def create(fs):
        try:
            fs.pipe_file(url.key, data, mode="create")
        except FileExistsError:  # gcsfs: HTTP 412, the precondition failed
            return False
        return True
    return _call(url, create)


def read_generation(url: GsPath) -> tuple[bytes, int] | None:
    """An object's bytes and its generation (None where there is none). The bytes are read after
    the generation, so they are that generation's or a later one's."""
    url = path(url)

    def read(fs):
        try:
            generation = int(fs.info(url.key)["generation"])
            return fs.cat_file(url.key), generation
        except FileNotFoundError:
            return None
    return _call(url, read)


def delete_generation(url: GsPath, generation: int) -> None:
    """Delete the object only while it is still `generation` (the precondition ifGenerationMatch);
    one gone or replaced meanwhile is left as it is."""
    url = path(url)

    def delete(fs):
        with contextlib.suppress(FileNotFoundError, FileExistsError):  # 404 gone, 412 replaced
            fs.call("DELETE", "b/{}/o/{}", url.bucket, url.key.split("/", 1)[1], ifGenerationMatch=str(generation))
    _call(url, delete)


def listing(url: GsPath) -> dict[str, int]:
    """{path under url: size} of every object under url (a prefix), at any depth."""
    url = path(url)
    def find(fs):
        return fs.find(url.key, detail=True)
    prefix = url.key + "/"
    return {name[len(prefix):]: int(info["size"]) for name, info in _call(url, find).items()
            if name.startswith(prefix)}


def delete(url: GsPath, rels) -> None:
    """Delete the objects url/rel (those already gone are fine)."""
    url = path(url)
    keys = [(url / rel).key for rel in rels]
    if keys:
        with contextlib.suppress(FileNotFoundError):
            _call(url, lambda fs: fs.rm(keys))


def upload(folder: Path, url: GsPath, *, last: str | None = None) -> None:
    """Every file under a local folder to url/<its path>, the file named `last` after all others."""
    url = path(url)
    files = sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file())
    for rel in sorted(files, key=lambda r: r == last):
        _call(url, lambda fs, rel=rel: fs.put_file(str(Path(folder) / rel), (url / rel).key))


def download(url: GsPath, folder: Path) -> None:
    """Every object under url to folder/<its path>."""
    url = path(url)
    for rel in listing(url):
        (Path(folder) / rel).parent.mkdir(parents=True, exist_ok=True)
        _call(url, lambda fs, rel=rel: fs.get_file((url / rel).key, str(Path(folder) / rel)))


@contextlib.contextmanager
def downloaded(url: GsPath):
    """A local temporary folder holding the objects under url (removed after the block)."""
    tmp = Path(tempfile.mkdtemp(prefix="isojax-gs-"))
    try:
        download(url, tmp)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def copy_name(path: Path) -> str | None:
    """For a file of a local copy of gs:// objects (local_copy): its path under the copies' folder,
    whose first part names the objects and their versions; the same on every host, whatever its
    cache's place and the copy's time. None for any other file."""
    path = path.resolve()
    if "gs" not in path.parts[:-1]:  # no look at the cache (which cache_root would create) for other files
        return None
    from isojax.hf.loading import cache_root
    try:
        return "gs/" + path.relative_to((cache_root() / "gs").resolve()).as_posix()
    except ValueError:
        return None


def local_copy(spec: str) -> str:
    """--data gs://...: a local copy of the object (or of every object under the prefix) in isojax's
    cache, under the same last name (a source's label), fetched once per version of the objects
    (their generations), so a second run reuses it and its tokens."""
    from isojax.atomic import staged_dir
    from isojax.hf.loading import cache_root

    url = GsPath(spec)
    check(url)

    def versions(fs):
        try:
            info = fs.info(url.key)
        except FileNotFoundError:
            info = None
        if info is not None and info.get("type") == "file":
            return {"": [info["size"], info.get("generation")]}
        return {name: [i["size"], i.get("generation")] for name, i in fs.find(url.key, detail=True).items()}

    found = _call(url, versions)
    if not found:
        raise UserError(f"{spec}: no such object or folder")
    key = hashlib.sha256(json.dumps([url.url, found], sort_keys=True).encode()).hexdigest()[:20]
    home = cache_root() / "gs" / key
    if not home.exists():
        with staged_dir(home) as tmp:
            if "" in found:
                _call(url, lambda fs: fs.get_file(url.key, str(tmp / url.name)))
            else:
                download(url, tmp / url.name)
    return str(home / url.name)
