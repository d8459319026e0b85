"""A real local S3 for tests and benchmarks: moto's ThreadedMotoServer on 127.0.0.1 over HTTP.

Clients are real boto3, pointed at the server by AWS_ENDPOINT_URL (no mock_aws, no patching),
so what is tested is what runs against AWS, MinIO or Ceph. On top of moto the server can
inject faults the way a real service shows them: 503 SlowDown replies, and stopping dead
(requests dropped without a reply, then the listener closed) right after a chosen request.

In a test module (one server per module, a fresh bucket per test):

    from tests.support.s3server import S3Server, serve_s3

    @pytest.fixture(scope="module")
    def s3_server() -> Iterator[S3Server]:
        yield from serve_s3()

    def test_something(s3_server: S3Server) -> None:
        bucket = s3_server.new_bucket()                   # or s3_server.bucket, made at start
        url = s3_server.url(bucket, "results")            # s3://<bucket>/results
        store = open_store(url)                           # the fixture set the AWS_* env vars
        subprocess.run([...], env=s3_server.subprocess_env())   # for esd-worker / esd-sweep
        s3_server.client().list_objects_v2(Bucket=bucket) # look behind the Store's back

Outside pytest: `with S3Server() as server: ...` then `server.env` or `server.subprocess_env()`.
In a process of its own (benchmarks, trying `esd-sweep run --output-dir s3://...` by hand):
`python -m tests.support.s3server [--bucket NAME]` prints `export AWS_...=...` lines (the first is
AWS_ENDPOINT_URL) to paste into another shell, then one `# serving ...` line, and serves
until its standard input closes (Ctrl+D) or it is interrupted.

Fault injection (to stop a server, start an `S3Server()` of the test's own, so that the
module's server stays up for the other tests):
- `fail_next(n, status=503, code="SlowDown")`: the next n requests get that S3 error reply.
- `stop_after(predicate)`: stop dead right after the first request for which
  `predicate(method, path)` is true has been answered, e.g. after the PUT of layers.csv.
- `stop()`: stop dead now. Later requests see a cut connection, then connection refused.
- `requests`: (method, path, query) of every request, to count what a client sent.
- `require_auth()`: a context manager in which moto checks signatures and IAM policies;
  `make_user(actions)` gives an access key with an IAM policy for those S3 actions.

moto keeps its state per process, not per server: buckets made through one server are seen
through every other in the same process. Use `new_bucket()` for a unique name per test.
`require_auth()` is process-wide too (moto's INITIAL_NO_AUTH_ACTION_COUNT).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from esd_worker.core.store.opener import open_store
from esd_worker.core.store.s3 import LIST_PAGE_SIZE, S3Store

REGION = "us-east-1"
ACCESS_KEY_ID = "testing"
SECRET_ACCESS_KEY = "testing"
# AWS variables that would point boto3 elsewhere than the test server, or slow it down.
_AWS_VARS_CLEARED = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ENDPOINT_URL_S3", "AWS_REGION",
    "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS", "AWS_CA_BUNDLE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)
_S3_ERROR = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>{code}</Code><Message>injected by tests/support/s3server.py</Message>"
    "<RequestId>injected</RequestId></Error>"
)
_bucket_numbers = itertools.count()

Request = tuple[str, str, str]  # method, path, query string


class S3Server:
    """moto's ThreadedMotoServer on 127.0.0.1 (a free port), with fault injection."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint = ""  # http://127.0.0.1:<port>, set by start()
        self.bucket = ""  # a bucket made by start(); new_bucket() makes more
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._failures: list[tuple[int, str]] = []
        self._stop_after: Callable[[str, str], bool] | None = None
        self._down = threading.Event()
        self._stopped = threading.Event()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> S3Server:
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        # moto's werkzeug server: wrap its WSGI app to record requests and inject faults.
        wsgi = self._moto._server
        assert wsgi is not None
        wsgi.app = _Middleware(self, wsgi.app)
        self.bucket = self.new_bucket()
        return self

    def stop(self) -> None:
        """Stop dead: drop requests still arriving, close the listener (then 'refused')."""
        self._down.set()
        if self._stopped.is_set():
            return
        self._stopped.set()
        wsgi = self._moto._server
        self._moto.stop()
        if wsgi is not None:
            wsgi.server_close()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- clients and environment -------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """AWS_* variables that point boto3 (the standard chain) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
            "AWS_DEFAULT_REGION": REGION,
            # No ~/.aws of the developer's, and no 1-second IMDS probes when keys are missing.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            "NO_PROXY": "127.0.0.1,localhost",
        }

    def subprocess_env(self, **overrides: str | None) -> dict[str, str]:
        """os.environ with this server's AWS_* variables; an override of None removes one."""
        env = {k: v for k, v in os.environ.items() if k not in _AWS_VARS_CLEARED}
        env.update(self.env)
        for name, value in overrides.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def apply_env(self, mp: pytest.MonkeyPatch) -> None:
        """Set this server's environment in this process (boto3 reads it when a client is made)."""
        for name in _AWS_VARS_CLEARED:
            mp.delenv(name, raising=False)
        for name, value in self.env.items():
            mp.setenv(name, value)

    def client(self, service: str = "s3", **credentials: str) -> Any:
        """A boto3 client for this server, independent of the process environment."""
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=credentials.get("aws_access_key_id", ACCESS_KEY_ID),
            aws_secret_access_key=credentials.get("aws_secret_access_key", SECRET_ACCESS_KEY),
        )

    def new_bucket(self, name: str | None = None) -> str:
        """Create a bucket (unique name unless given) and return its name."""
        name = name or f"esd-test-{next(_bucket_numbers)}-{uuid.uuid4().hex[:8]}"
        self.client().create_bucket(Bucket=name)
        return name

    @staticmethod
    def url(bucket: str, prefix: str = "") -> str:
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under prefix in bucket, straight from the server."""
        pages = self.client().get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix
        )
        return [item["Key"] for page in pages for item in page.get("Contents", ())]

    # -- faults -------------------------------------------------------------------------------

    def fail_next(self, n: int, *, status: int = 503, code: str = "SlowDown") -> None:
        """The next n requests are answered with an S3 error reply instead of by moto."""
        with self._lock:
            self._failures.extend([(status, code)] * n)

    def stop_after(self, predicate: Callable[[str, str], bool]) -> None:
        """Stop dead once the first request matching predicate(method, path) is answered."""
        self._stop_after = predicate

    def make_user(self, actions: Iterable[str] = ("s3:*",)) -> tuple[str, str]:
        """An IAM user allowed `actions` on every S3 resource: (access key id, secret key)."""
        iam = self.client("iam")
        name = f"esd-user-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": list(actions), "Resource": "*"}]}
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    @contextmanager
    def require_auth(self) -> Iterator[None]:
        """Inside: moto checks every request's signature and IAM policy, as AWS does."""
        self._set_auth_after("0")
        try:
            yield
        finally:
            self._set_auth_after("inf")

    def _set_auth_after(self, count: str) -> None:
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
            headers={"Content-Type": "text/plain"},  # a form type would hide the body
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            reply.read()

    # -- used by the middleware ---------------------------------------------------------------

    def _injected_failure(self) -> tuple[int, str] | None:
        with self._lock:
            return self._failures.pop(0) if self._failures else None

    def _last_request(self, method: str, path: str) -> bool:
        """True for the request that stop_after waits for: it is answered, later ones are not.

        Set on arrival, not after the reply: werkzeug lingers ~10 ms after a reply, long
        enough for a fast client's next request to arrive on a new connection.
        """
        predicate = self._stop_after
        if predicate is None or not predicate(method, path):
            return False
        self._stop_after = None
        self._down.set()
        return True


class _Middleware:
    """WSGI wrapper around moto: records requests, injects errors, plays dead once stopped."""

    def __init__(self, server: S3Server, app: Any) -> None:
        self.server = server
        self.app = app

    def __call__(self, environ: MutableMapping[str, Any], start_response: Any) -> Iterable[bytes]:
        server = self.server
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        if server._down.is_set():
            # A dead server: the connection drops without a reply (werkzeug's dev server
            # closes every connection after one reply, so only new ones get here).
            with suppress(OSError):
                environ["werkzeug.socket"].shutdown(socket.SHUT_RDWR)
            start_response("503 Down", [("Content-Length", "0")])  # written to nobody
            return []
        server.requests.append((method, path, environ.get("QUERY_STRING", "")))
        failure = server._injected_failure()
        if failure is not None:
            status, code = failure
            body = _S3_ERROR.format(code=code).encode()
            start_response(f"{status} Injected", [("Content-Type", "application/xml"),
                                                   ("Content-Length", str(len(body)))])
            return [body]
        if server._last_request(method, path):
            body = self.app(environ, start_response)
            return _OnClose(body, lambda: threading.Thread(target=server.stop, daemon=True).start())
        return self.app(environ, start_response)


class _OnClose:
    """A WSGI body that calls `then` after the server has written it out."""

    def __init__(self, body: Iterable[bytes], then: Callable[[], None]) -> None:
        self.body = body
        self.then = then

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.body)

    def close(self) -> None:
        close = getattr(self.body, "close", None)
        if close is not None:
            close()
        self.then()


def serve_s3() -> Iterator[S3Server]:
    """The body of a fixture: an S3Server with its AWS_* environment set in this process."""
    with S3Server() as server, pytest.MonkeyPatch.context() as mp:
        server.apply_env(mp)
        yield server


def main(argv: list[str] | None = None) -> int:
    """Serve S3 in this process until standard input closes (or Ctrl+C)."""
    parser = argparse.ArgumentParser(description="a local S3 (moto) on 127.0.0.1")
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket")
    parser.add_argument("--seed-markers", type=Path, metavar="FILE",
                        help="model keys, one a line: a marker (default parameters) for each "
                        "in the first --bucket, put into moto directly (benchmarks: faster "
                        "than uploading 10^5 objects)")
    parser.add_argument("--seed-prefix", default="", help="the store's prefix in that bucket")
    args = parser.parse_args(argv)
    with S3Server() as server:
        for name in args.bucket:
            server.new_bucket(name)
        if args.seed_markers is not None:
            seed_markers(args.bucket[0], args.seed_prefix, args.seed_markers)
        for name, value in server.env.items():
            print(f"export {name}={shlex.quote(value)}")
        buckets = " ".join(server.url(name) for name in [server.bucket, *args.bucket])
        print(f"# serving {buckets} until standard input closes", flush=True)
        with suppress(KeyboardInterrupt):
            sys.stdin.read()
    return 0


def seed_markers(bucket: str, prefix: str, keys_file: Path) -> int:
    """A result for each model key of keys_file (its layers.csv and a marker sealing it),
    written into moto's backend (no HTTP)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    from esd_worker.core.command.settings import AnalysisSettings
    from esd_worker.core.store.layout import marker_key, model_file_key
    from esd_worker.core.store.marker import LAYERS_NAME, FileSeal, Marker, canonical_parameters

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    params = canonical_parameters(AnalysisSettings().as_dict())
    base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""

    count = 0
    with open(keys_file) as f:
        for line in f:
            key = line.strip()
            if key:
                marker = Marker(model=key, model_key=key, parameters=params,
                                files={LAYERS_NAME: FileSeal.of(LAYERS)})
                backend.put_object(bucket, base + model_file_key(key, LAYERS_NAME), LAYERS)
                backend.put_object(bucket, base + marker_key(key), marker.to_json())
                count += 1
    return count


LAYERS = b"layer,alpha\nl0,3.0\n"


def make_store(server: S3Server, prefix: str = "results", *,
               list_page_size: int = LIST_PAGE_SIZE) -> S3Store:
    """An S3Store on a fresh bucket of `server`, opened the way the worker opens one."""
    store = open_store(server.url(server.new_bucket(), prefix))
    assert isinstance(store, S3Store)
    store.list_page_size = list_page_size
    return store


STORE_KINDS = ("folder", "s3")


def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """For a fixture parametrized over STORE_KINDS: an empty results location, a folder
    under tmp_path or a fresh bucket of the module's `s3_server` fixture (moto over HTTP)."""
    if request.param == "folder":
        return str(tmp_path / "results")
    server: S3Server = request.getfixturevalue("s3_server")
    return server.url(server.new_bucket(), "results")


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ESD_WORKER = Path(sys.executable).with_name("esd-worker")


PREFIX = "sweep/atlas"


@dataclass
class WorkerRun:
    """One `esd-worker` process writing to s3://bucket/PREFIX on `server`."""

    server: S3Server
    bucket: str
    secret: str
    proc: subprocess.Popen[str]
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""

    def result(self) -> WorkerRun:
        if self.returncode is None:
            self.stdout, self.stderr = self.proc.communicate(timeout=300)
            self.returncode = self.proc.returncode
        return self

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.result().stderr.splitlines()
                if line.startswith("esd-worker: error:")]


_STARTED: list[WorkerRun] = []


def start_worker(server: S3Server, bucket: str, model: Path) -> WorkerRun:
    """`esd-worker -v` on `model` into s3://bucket/PREFIX, with a secret of its own."""
    secret = f"esd-secret-{uuid.uuid4().hex}"
    env = server.subprocess_env(AWS_SECRET_ACCESS_KEY=secret, AWS_MAX_ATTEMPTS="2",
                                HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [str(ESD_WORKER), "--model", str(model), "--device", "cpu", "-v",
         "--output", server.url(bucket, PREFIX)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    run = WorkerRun(server, bucket, secret, proc)
    _STARTED.append(run)
    return run


def wait_for_workers() -> None:
    for run in _STARTED:
        run.result()


if __name__ == "__main__":
    sys.exit(main())
