"""controller.weights.sizing's hub token: sent as a bearer token, never logged, taken from
HF_TOKEN, and
never sent to another host after a redirect. These need the request headers, which the hub
double does not keep: a small header-recording server (HeaderServer) stands in for it.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.controller.test_sizing import (  # noqa: F401 (clean_env: an autouse fixture)
    DEFAULT,
    TOKEN,
    FakeTime,
    clean_env,
    make_row,
    make_sizer,
)


@pytest.fixture
def clock() -> FakeTime:
    """test_sizing's clock that moves only when slept on (its retries wait on it)."""
    return FakeTime()

# --- the token ------------------------------------------------------------------------------


class HeaderServer:
    """Answers GET with the scripted (status, headers, body) of its path, else a model with
    one 500-byte model.safetensors; records (path, Authorization header) of every request."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.script: dict[str, list[tuple[int, dict[str, str], bytes]]] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                server.seen.append((path, self.headers.get("Authorization")))
                answers = server.script.get(path)
                status, headers, body = answers.pop(0) if answers else (
                    200, {}, json.dumps({"siblings": [
                        {"rfilename": "model.safetensors", "size": 500}]}).encode())
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HeaderServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def test_token_sent_as_bearer_and_never_logged(clock: FakeTime,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Every request, retries and failures included, carries the token; no log record, at any
    level, holds it."""
    with HeaderServer() as server:
        server.script["/api/models/org/busy/revision/main"] = [(429, {"Retry-After": "1"}, b"")]
        server.script["/api/models/org/gated/revision/main"] = [(403, {}, b"{}")]
        server.script["/api/models/org/down/revision/main"] = [(503, {}, b"")] * 4
        sizer = make_sizer(server.url, clock, token=TOKEN)
        with caplog.at_level(logging.DEBUG):
            sizes = [sizer.size(make_row(f"org/{m}")) for m in ("ok", "busy", "gated", "down")]
            sizer.log_stats()
    assert sizes == [500, 500, DEFAULT, DEFAULT]
    assert len(server.seen) == 1 + 2 + 1 + 4
    assert {auth for _, auth in server.seen} == {f"Bearer {TOKEN}"}
    assert caplog.records  # the failures were logged...
    for record in caplog.records:  # ...without the token
        assert TOKEN not in record.getMessage() and TOKEN not in repr(record.__dict__)


@pytest.mark.parametrize(("env_token", "expected"), [(TOKEN, f"Bearer {TOKEN}"), ("", None)],
                         ids=["HF_TOKEN", "no-token"])
def test_token_from_the_environment(clock: FakeTime, monkeypatch: pytest.MonkeyPatch,
                                    env_token: str, expected: str | None) -> None:
    monkeypatch.setenv("HF_TOKEN", env_token)
    with HeaderServer() as server:
        assert make_sizer(server.url, clock).size(make_row("org/model")) == 500
    assert server.seen == [("/api/models/org/model/revision/main", expected)]


def test_token_follows_a_redirect_only_to_the_same_host(clock: FakeTime) -> None:
    """A renamed repo answers 307 to its new name: the hub gets the token again; another host
    (here another port) does not."""
    with HeaderServer() as hub, HeaderServer() as elsewhere:
        hub.script["/api/models/org/old/revision/main"] = [
            (307, {"Location": "/api/models/org/new/revision/main?blobs=true"}, b"")]
        hub.script["/api/models/org/leak/revision/main"] = [
            (307, {"Location": f"{elsewhere.url}/api/models/org/x/revision/main"}, b"")]
        sizer = make_sizer(hub.url, clock, token=TOKEN)
        assert sizer.size(make_row("org/old")) == 500
        assert sizer.size(make_row("org/leak")) == 500
    assert hub.seen == [("/api/models/org/old/revision/main", f"Bearer {TOKEN}"),
                        ("/api/models/org/new/revision/main", f"Bearer {TOKEN}"),
                        ("/api/models/org/leak/revision/main", f"Bearer {TOKEN}")]
    assert elsewhere.seen == [("/api/models/org/x/revision/main", None)]
