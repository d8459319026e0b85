"""A local stand-in for the HuggingFace hub's HTTP API, for tests that drive the real
`huggingface_hub` client against it (HF_ENDPOINT=hub.url, see `HubServer.env`).

Owns: model repos registered from local directories (several revisions each, a fake but
stable 40-hex commit per revision), what huggingface_hub 2.x asks of the hub to look a model
up and download it, byte throttling of file bodies, table-friendly fault injection and a
log of every request (to count calls).

Endpoints, as huggingface_hub 2.4 calls them:
- GET /api/models/{repo}[/revision/{rev}][?blobs=True]: model_info / repo_info. `sha`, `id`,
  `private`, `gated`, `siblings` (rfilename; size, blobId and lfs with blobs=True), and
  `safetensors` (parameters per dtype, total) read from the root safetensors headers.
- GET /api/models/{repo}/tree/{rev}: the recursive file listing snapshot_download asks for
  (one page, no Link header).
- HEAD/GET /{repo}/resolve/{rev}/{file}: X-Repo-Commit always. A plain file is served with
  ETag "<git blob sha1>" and Content-Length; an LFS file (*.safetensors, *.bin) answers 302
  with X-Linked-Etag "<sha256>", X-Linked-Size and a Location on the `cdn_host` origin
  ("localhost" by default: another origin than 127.0.0.1, so the client stops at the 302 and
  reads the metadata from it, as it does for the real CDN).
- GET /cdn/{repo}/{sha}/{file}: the LFS bodies. Bodies honour a single `Range: bytes=a-b`.
- Errors carry X-Error-Code as the hub does: RepoNotFound, RevisionNotFound, EntryNotFound
  (404), GatedRepo (403); Retry-After when a fault asks for it.

- GET /api/whoami-v2: the user of the `Authorization: Bearer` token when a test registered
  it (`add_token`), else 401 as the hub answers an invalid token.

Does not emulate: authentication of the model endpoints (any Authorization header is ignored
there: use `fail` for 401 and 403), xet storage, uploads/commits, datasets and spaces, tags
(revisions are branches or full commit shas), pagination, HTTP-date Retry-After, multi-range
requests, compression. Whole files are held in memory: for tiny test models only.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")
# What a subprocess must not inherit: another hub, cache, token or offline switch, or a proxy.
_HF_VARS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HF_ENDPOINT",
            "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME", "HF_TOKEN_PATH",
            "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


@dataclass(frozen=True)
class Request:
    """One request as answered. kind: "api", "file" (resolve), "cdn" (LFS body) or "other".
    started: when it arrived (time.monotonic(), comparable with the test process's clock)."""

    method: str
    path: str
    status: int
    kind: str
    repo: str | None = None
    file: str | None = None
    started: float = 0.0


@dataclass
class Fault:
    """Answer `status` instead of the real response, `times` more times (None: always)."""

    repo: str
    status: int
    times: int | None = 1
    retry_after: int | None = None
    on: str | None = None  # None: any request about the repo; "api"; or a file name
    method: str | None = None
    error_code: str | None = None
    delay_s: float = 0.0  # wait this long first; with status 0, then answer normally

    def matches(self, request: Request) -> bool:
        if self.repo != request.repo or self.times == 0:
            return False
        if self.method is not None and self.method != request.method:
            return False
        return self.on is None or self.on == (request.kind if self.on == "api" else request.file)


@dataclass(frozen=True)
class _File:
    data: bytes
    blob_id: str  # git's blob sha1: what the hub reports as blobId and the ETag of plain files
    sha256: str
    lfs: bool


@dataclass
class _Repo:
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, _File]] = field(default_factory=dict)


def _read_files(directory: Path) -> dict[str, _File]:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = path.read_bytes()
        name = path.relative_to(directory).as_posix()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        files[name] = _File(data, blob, hashlib.sha256(data).hexdigest(),
                            name.endswith(LFS_SUFFIXES))
    return files


class HubServer:
    """The hub double; start it with `with HubServer() as hub:` (or start()/stop())."""

    def __init__(self, host: str = "127.0.0.1", cdn_host: str = "localhost") -> None:
        self.throttle_bytes_per_s: float | None = None
        self.cdn_host = cdn_host
        self._repos: dict[str, _Repo] = {}
        self._faults: list[Fault] = []
        self._tokens: dict[str, str] = {}  # token -> user name (whoami)
        self._log: list[Request] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, 0), _Handler)
        self._server.daemon_threads = True
        self._server.hub = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self._server.server_address[0]}:{self.port}"

    def add_repo(self, repo_id: str, directory: Path, *, revision: str = "main") -> str:
        """Serve `directory`'s files (recursively) as branch `revision` of `repo_id`; returns the
        commit sha (stable: derived from the repo, the branch and the files' contents)."""
        files = _read_files(Path(directory))
        digest = hashlib.sha1(f"{repo_id}@{revision}".encode())
        for name, f in files.items():
            digest.update(f"{name}:{f.blob_id}\n".encode())
        sha = digest.hexdigest()
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo())
            repo.branches[revision] = sha
            repo.commits[sha] = files
        return sha

    def add_token(self, token: str, user: str) -> None:
        """Make `token` valid for /api/whoami-v2, as `user`'s read token."""
        with self._lock:
            self._tokens[token] = user

    def fail(self, repo: str, status: int, *, times: int | None = 1,
             retry_after: int | None = None, on: str | None = None, method: str | None = None,
             error_code: str | None = None) -> Fault:
        """Answer `status` to the next `times` matching requests (None: every one).

        on: None (any request about `repo`), "api" (its /api/models requests) or a file name
        (resolve and CDN requests for that file); method: "HEAD"/"GET" or None for both.
        error_code (X-Error-Code) defaults to what the hub sends: 403 GatedRepo, 404
        EntryNotFound for a file and RepoNotFound otherwise; "" sends none.
        """
        if error_code is None:
            defaults = {403: "GatedRepo", 404: "RepoNotFound" if on in (None, "api") else
                        "EntryNotFound"}
            error_code = defaults.get(status, "")
        fault = Fault(repo, status, times, retry_after, on, method, error_code or None)
        with self._lock:
            self._faults.append(fault)
        return fault

    def delay(self, repo: str, seconds: float, *, times: int | None = 1,
              on: str | None = None) -> Fault:
        """Hold the next `times` matching requests (`on` as for fail) `seconds` before
        answering them normally: a slow hub, for races between a worker's threads."""
        fault = Fault(repo, 0, times, on=on, delay_s=seconds)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._log)

    def calls(self, method: str | None = None, *, kind: str | None = None,
              file: str | None = None, status: int | None = None) -> list[Request]:
        """The logged requests matching every filter given."""
        return [r for r in self.requests
                if (method is None or r.method == method) and (kind is None or r.kind == kind)
                and (file is None or r.file == file) and (status is None or r.status == status)]

    def clear_log(self) -> None:
        with self._lock:
            self._log.clear()

    def env(self, hf_home: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a subprocess whose huggingface_hub talks to this hub (online, no
        token, cache under hf_home, no telemetry or progress bars, no proxy for it)."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if k not in _HF_VARS}
        return env | {
            "HF_ENDPOINT": self.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(hf_home),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "NO_PROXY": f"127.0.0.1,{self.cdn_host}", "no_proxy": f"127.0.0.1,{self.cdn_host}",
        }

    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name="hubserver",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- used by the handler ---------------------------------------------------------------

    def _take_fault(self, request: Request) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(request):
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

    def _record(self, request: Request) -> None:
        with self._lock:
            self._log.append(request)

    def _commit(self, repo_id: str, revision: str) -> tuple[str, dict[str, _File]] | None:
        with self._lock:
            repo = self._repos[repo_id]
            sha = repo.branches.get(revision, revision)
            return (sha, repo.commits[sha]) if sha in repo.commits else None

    def _has_repo(self, repo_id: str) -> bool:
        with self._lock:
            return repo_id in self._repos


def _parse(path: str) -> tuple[str, str | None, str | None, str | None, str]:
    """(kind, repo, revision, file, api_tail) of a request path."""
    parts = path.strip("/").split("/")
    if parts[:2] == ["api", "models"]:
        rest = parts[2:]
        for i, part in enumerate(rest):
            if part in ("revision", "tree") and i in (1, 2) and len(rest) > i + 1:
                return "api", "/".join(rest[:i]), unquote(rest[i + 1]), None, part
        return "api", "/".join(rest), "main", None, "info"
    if parts[0] == "cdn" and len(parts) >= 5:
        return "cdn", "/".join(parts[1:3]), parts[3], unquote("/".join(parts[4:])), ""
    if "resolve" in parts[1:3]:
        i = parts.index("resolve")
        if len(parts) > i + 2:
            return ("file", "/".join(parts[:i]), unquote(parts[i + 1]),
                    unquote("/".join(parts[i + 2:])), "")
    return "other", None, None, None, ""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    server: Any
    _seen: Request  # the request being answered, logged by _send as its answer leaves

    def log_message(self, format: str, *args: Any) -> None:  # the request log is enough
        pass

    def do_HEAD(self) -> None:
        self._serve()

    def do_GET(self) -> None:
        self._serve()

    def _serve(self) -> None:
        hub: HubServer = self.server.hub
        started = time.monotonic()
        path = urlsplit(self.path).path
        if path == "/api/whoami-v2":
            self._seen = Request(self.command, path, 0, "api", started=started)
            status, body = self._whoami()
            self._send(status, json.dumps(body).encode(), {"Content-Type": "application/json"})
            return
        kind, repo, revision, file, tail = _parse(path)
        seen = self._seen = Request(self.command, path, 0, kind, repo, file, started)
        fault = hub._take_fault(seen) if repo is not None else None
        if fault is not None and fault.delay_s:
            time.sleep(fault.delay_s)
        if fault is not None and fault.status:
            wait = fault.retry_after
            headers = {"Retry-After": str(wait)} if wait is not None else {}
            self._error(fault.status, fault.error_code, "injected fault", headers)
        elif repo is None or not hub._has_repo(repo):
            self._error(404, "RepoNotFound", "Repository not found")
        elif (commit := hub._commit(repo, revision or "main")) is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        elif kind == "api":
            self._api(repo, *commit, tail)
        elif file not in commit[1]:
            self._error(404, "EntryNotFound", f"{file} does not exist",
                        {"X-Repo-Commit": commit[0]})
        else:
            self._file(repo, commit[0], file, commit[1][file], kind == "cdn")

    def _whoami(self) -> tuple[int, dict[str, Any]]:
        hub: HubServer = self.server.hub
        auth = self.headers.get("Authorization") or ""
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        with hub._lock:
            user = hub._tokens.get(token) if token else None
        if user is None:
            return 401, {"error": "Invalid credentials in Authorization header"}
        return 200, {"type": "user", "name": user, "fullname": user, "orgs": [],
                     "auth": {"type": "access_token",
                              "accessToken": {"displayName": "esd-sweep tests", "role": "read"}}}

    def _api(self, repo: str, sha: str, files: dict[str, _File], tail: str) -> int:
        if tail == "tree":
            body: Any = [{"type": "file", "path": n, "size": len(f.data), "oid": f.blob_id,
                          **({"lfs": {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}}
                             if f.lfs else {})} for n, f in files.items()]
        else:
            blobs = "blobs=" in (urlsplit(self.path).query or "")
            body = {"id": repo, "modelId": repo, "sha": sha, "private": False, "gated": False,
                    "disabled": False, "siblings": [
                        {"rfilename": n, **({"size": len(f.data), "blobId": f.blob_id} if blobs
                                            else {}),
                         **({"lfs": {"size": len(f.data), "sha256": f.sha256, "pointerSize": 134}}
                            if blobs and f.lfs else {})} for n, f in files.items()]}
            if (counts := _safetensors_params(files)) is not None:
                body["safetensors"] = {"parameters": counts, "total": sum(counts.values())}
        return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _file(self, repo: str, sha: str, name: str, f: _File, from_cdn: bool) -> int:
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if f.lfs and not from_cdn:
            location = f"http://{self.server.hub.cdn_host}:{self.server.hub.port}/cdn/{repo}/{sha}/"
            headers |= {"Location": location + quote(name), "X-Linked-Etag": f'"{f.sha256}"',
                        "X-Linked-Size": str(len(f.data)), "ETag": f'"{f.blob_id}"'}
            return self._send(302, b"", headers)
        headers["ETag"] = f'"{f.sha256 if f.lfs else f.blob_id}"'
        data, status = f.data, 200
        if (rng := self.headers.get("Range")) and rng.startswith("bytes=") and "," not in rng:
            start_s, _, end_s = rng[6:].partition("-")
            start = int(start_s) if start_s else max(len(data) - int(end_s), 0)
            end = int(end_s) if start_s and end_s else len(data) - 1
            if start >= len(data):
                return self._error(416, "", "Range not satisfiable")
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start:end + 1], 206
        return self._send(status, data, headers, throttle=True)

    def _error(self, status: int, code: str | None, message: str,
               headers: Mapping[str, str] | None = None) -> int:
        extra = {"Content-Type": "application/json", **(headers or {})}
        if code:
            extra |= {"X-Error-Code": code, "X-Error-Message": message}
        return self._send(status, json.dumps({"error": message}).encode(), extra)

    def _send(self, status: int, body: bytes, headers: Mapping[str, str],
              throttle: bool = False) -> int:
        # Logged before the answer leaves: a test reads the log as soon as its client has
        # the answer, which may be before this thread would have logged it after sending.
        self.server.hub._record(replace(self._seen, status=status))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            for chunk in _paced(body, self.server.hub.throttle_bytes_per_s if throttle else None):
                self.wfile.write(chunk)
        return status


def _safetensors_params(files: Mapping[str, _File]) -> dict[str, int] | None:
    """The model info's `safetensors.parameters` as the hub reports it: elements per dtype
    over the root *.safetensors files' headers; None when there are none or one does not
    parse (the hub then leaves the field out)."""
    counts: dict[str, int] = {}
    names = [n for n in files if n.endswith(".safetensors") and "/" not in n]
    for name in names:
        data = files[name].data
        try:
            length = int.from_bytes(data[:8], "little")
            header = json.loads(data[8:8 + length])
            for tensor, info in header.items():
                if tensor != "__metadata__":
                    count = 1
                    for dim in info["shape"]:
                        count *= dim
                    counts[info["dtype"]] = counts.get(info["dtype"], 0) + count
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
    return counts if names else None


def _paced(body: bytes, rate: float | None) -> Iterator[bytes]:
    """body in chunks, each released no earlier than `rate` bytes per second allows."""
    if not rate:
        yield body
        return
    step = max(1, min(16384, int(rate / 20)))  # ~20 chunks a second: a smooth, accurate pace
    start = time.monotonic()
    for offset in range(0, len(body), step):
        chunk = body[offset:offset + step]
        # Release each chunk when its last byte is due, so the whole body takes len/rate.
        delay = start + (offset + len(chunk)) / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        yield chunk
