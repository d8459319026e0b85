"""Tests of the S3 store against moto's standalone server over HTTP, through real boto3.

No mock_aws and no patching: boto3 finds the server through AWS_ENDPOINT_URL, as it finds
MinIO or AWS itself, and faults are what a server does (error replies, dying mid-run;
tests/support/s3server.py). The worker runs end to end as the `esd-worker` command on a tiny GPT-2
(conftest's gpt2_dir).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from esd_worker.core.errors import (
    EXIT_PERMANENT,
    EXIT_TRANSIENT,
    StoreError,
    StorePermanentError,
    UsageError,
)
from esd_worker.core.store.layout import EIGS_NAME, MARKER_NAME
from esd_worker.core.store.marker import LAYERS_NAME
from esd_worker.core.store.opener import open_store
from esd_worker.core.store.results import layers_from_csv
from esd_worker.core.store.s3 import DEFAULT_MAX_ATTEMPTS, MULTIPART_THRESHOLD, S3Store
from tests.support.s3server import (
    PREFIX,
    S3Server,
    WorkerRun,
    closed_port,
    make_store,
    serve_s3,
    start_worker,
    wait_for_workers,
)

# --- builders -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """One server for the module; each test makes its own bucket."""
    yield from serve_s3()








# --- the Store contract over HTTP -----------------------------------------------------------


def test_round_trip_under_the_prefix(s3_server: S3Server) -> None:
    """Keys are '/'-joined under the URL's prefix; missing keys read None / False."""
    store = make_store(s3_server, "sweeps/run1")
    assert store.get_bytes("m/result.json") is None
    assert not store.exists("m/result.json")
    store.put_bytes("m/result.json", b"{}\n")
    store.put_bytes("/m//layers.csv", b"a,b\n")  # normalised like LocalStore keys
    assert store.get_bytes("m/result.json") == b"{}\n"
    assert store.exists("m/result.json")
    assert sorted(s3_server.keys(store.bucket)) == ["sweeps/run1/m/layers.csv",
                                                    "sweeps/run1/m/result.json"]
    store.put_bytes("m/result.json", b"new")
    assert store.get_bytes("m/result.json") == b"new"
    store.delete("m/result.json")
    store.delete("m/result.json")  # a missing key is not an error
    assert not store.exists("m/result.json")
    assert list(store.list_keys()) == ["m/layers.csv"]


def test_bucket_without_prefix(s3_server: S3Server) -> None:
    store = open_store(s3_server.url(s3_server.new_bucket()))
    assert isinstance(store, S3Store) and store.prefix == ""
    store.put_bytes("m/result.json", b"{}")
    assert s3_server.keys(store.bucket) == ["m/result.json"]
    assert list(store.list_keys()) == ["m/result.json"]
    assert list(store.list_keys("m")) == ["m/result.json"]


def test_list_keys_is_by_folder_and_leaves_out_other_prefixes(s3_server: S3Server) -> None:
    """As with LocalStore, list_keys('a') is the folder a/, not every key starting with 'a'."""
    store = make_store(s3_server, "run")
    other = S3Store(store.bucket, "run-other")  # a sibling prefix in the same bucket
    other.put_bytes("a/result.json", b"x")
    for key in ("a/result.json", "ab/result.json", "_failures/a.json", "summary.csv"):
        store.put_bytes(key, b"x")
    assert sorted(store.list_keys()) == ["_failures/a.json", "a/result.json", "ab/result.json",
                                         "summary.csv"]
    assert list(store.list_keys("a")) == ["a/result.json"]
    assert list(store.list_keys("a/")) == ["a/result.json"]
    assert list(store.list_keys("_failures")) == ["_failures/a.json"]
    assert list(store.list_keys("missing")) == []
    store.put_bytes("a/layers.csv", b"x" * 17)  # sizes come with the same listing
    assert sorted(store.list_sizes("a")) == [("a/layers.csv", 17), ("a/result.json", 1)]



def test_list_keys_pages_through_listobjectsv2(s3_server: S3Server) -> None:
    """120 keys in pages of 50: exactly 3 ListObjectsV2 requests, not one per key.

    The page size is lowered from 1000 (S3's maximum, the default) so the test stays fast;
    benchmarks/bench_s3_list.py lists 10,000 markers with the default.
    """
    store = make_store(s3_server, "paged", list_page_size=50)
    keys = [f"m{i:04d}/{MARKER_NAME}" for i in range(120)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(store.put_bytes, keys, [b"{}"] * len(keys)))
    before = len(s3_server.requests)
    assert sorted(store.list_keys()) == keys
    lists = [r for r in s3_server.requests[before:] if "list-type=2" in r[2]]
    assert len(lists) == 3
    assert all(r[1] == f"/{store.bucket}" for r in lists)


def test_large_values_go_through_multipart_upload(s3_server: S3Server) -> None:
    """Above 8 MiB, boto3's managed transfer: CreateMultipartUpload, parts, complete."""
    store = make_store(s3_server)
    data = bytes(range(256)) * ((MULTIPART_THRESHOLD + 2**20) // 256)
    before = len(s3_server.requests)
    store.put_bytes("m/eigs.npz", data)
    queries = [r[2] for r in s3_server.requests[before:]]
    assert "uploads" in queries  # POST ?uploads starts a multipart upload
    assert sum("partNumber=" in q for q in queries) == 2
    assert store.get_bytes("m/eigs.npz") == data


def test_small_values_are_one_put(s3_server: S3Server) -> None:
    store = make_store(s3_server)
    before = len(s3_server.requests)
    store.put_bytes("m/result.json", b"{}")
    assert [r[0] for r in s3_server.requests[before:]] == ["PUT"]


def test_concurrent_reads_share_one_client(s3_server: S3Server) -> None:
    """The controller reads markers from many threads through one store."""
    store = make_store(s3_server)
    keys = [f"m{i}/{MARKER_NAME}" for i in range(32)]
    for key in keys:
        store.put_bytes(key, key.encode())
    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(store.get_bytes, keys)) == [k.encode() for k in keys]


# --- configuration from the standard AWS chain ----------------------------------------------


def test_endpoint_comes_from_aws_endpoint_url(s3_server: S3Server) -> None:
    """boto3 reads AWS_ENDPOINT_URL itself: nothing in esd_worker passes an endpoint."""
    assert make_store(s3_server).endpoint == s3_server.endpoint


@pytest.mark.parametrize(
    ("env", "mode", "attempts"),
    [
        pytest.param({}, "standard", DEFAULT_MAX_ATTEMPTS, id="defaults"),
        pytest.param({"AWS_RETRY_MODE": "adaptive"}, "adaptive", DEFAULT_MAX_ATTEMPTS,
                     id="adaptive-from-env"),
        pytest.param({"AWS_MAX_ATTEMPTS": "2"}, "standard", 2, id="attempts-from-env"),
    ],
)
def test_retry_settings(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch,
                        env: dict[str, str], mode: str, attempts: int) -> None:
    """Standard retries by default; the user's AWS_RETRY_MODE / AWS_MAX_ATTEMPTS win."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = make_store(s3_server)._client.meta.config
    assert config.retries == {"mode": mode, "total_max_attempts": attempts}
    assert config.max_pool_connections >= 32
    assert config.connect_timeout and config.read_timeout


def test_session_token_stays_out_of_debug_logs(s3_server: S3Server,
                                               monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """botocore's DEBUG lines carry X-Amz-Security-Token; the store keeps them off even at -v."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", "TOKEN-SENTINEL-4f1c")
    caplog.set_level(logging.DEBUG)
    store = make_store(s3_server)
    store.put_bytes("m/result.json", b"{}")
    store.get_bytes("m/result.json")
    assert "TOKEN-SENTINEL-4f1c" not in caplog.text


# --- errors: permanent (exit 3) and transient (exit 4) --------------------------------------


def test_missing_bucket_is_permanent(s3_server: S3Server) -> None:
    """Every operation on a bucket that is not there says so in one line (exit 3)."""
    store = open_store("s3://esd-no-such-bucket/results")
    calls = {
        "put": lambda: store.put_bytes("m/result.json", b"{}"),
        "get": lambda: store.get_bytes("m/result.json"),
        "exists": lambda: store.exists("m/result.json"),
        "list": lambda: list(store.list_keys()),
        "delete": lambda: store.delete("m/result.json"),
        "check": store.check,
    }
    for name, call in calls.items():
        with pytest.raises(StorePermanentError) as info:
            call()
        message = str(info.value)
        assert message.startswith(
            "s3://esd-no-such-bucket: bucket does not exist or is not yours"), name
        assert "\n" not in message and info.value.exit_code == EXIT_PERMANENT


@dataclass
class Auth:
    """A bucket made before auth was switched on, and keys of two IAM users."""

    bucket: str
    full: tuple[str, str]
    readonly: tuple[str, str]


@pytest.fixture
def auth(s3_server: S3Server) -> Iterator[Auth]:
    """moto checks signatures and IAM policies (as AWS does) for the test's duration.

    The switch is process-wide: the worker runs below finish first, or they would be refused.
    """
    wait_for_workers()
    setup = Auth(s3_server.new_bucket(), s3_server.make_user(["s3:*"]),
                 s3_server.make_user(["s3:GetObject"]))
    with s3_server.require_auth():
        yield setup


def use_credentials(monkeypatch: pytest.MonkeyPatch, key_id: str, secret: str) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)


def test_valid_credentials_pass_the_servers_checks(s3_server: S3Server, auth: Auth,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    use_credentials(monkeypatch, *auth.full)
    store = open_store(s3_server.url(auth.bucket, "results"))
    store.check()
    store.put_bytes("m/result.json", b"{}")
    assert list(store.list_keys()) == ["m/result.json"]


@pytest.mark.parametrize(
    ("who", "message"),
    [
        pytest.param("unknown-key", "the access key id is not known to the store "
                     "(InvalidAccessKeyId, HTTP 403): check AWS_ACCESS_KEY_ID", id="unknown-key"),
        pytest.param("wrong-secret", "request signature rejected (SignatureDoesNotMatch, "
                     "HTTP 403): check AWS_SECRET_ACCESS_KEY", id="wrong-secret"),
        pytest.param("readonly", "access denied (AccessDenied, HTTP 403) trying to write "
                     "results/m/result.json: check the credentials", id="policy-denies"),
    ],
)
def test_bad_credentials_are_permanent(s3_server: S3Server, auth: Auth,
                                       monkeypatch: pytest.MonkeyPatch, who: str,
                                       message: str) -> None:
    """One line that says what to check (exit 3); the secret never appears in it."""
    key_id, secret = {
        "unknown-key": ("AKIAEXAMPLEUNKNOWN01", "unknown-secret-b7e2"),
        "wrong-secret": (auth.full[0], "wrong-secret-b7e2"),
        "readonly": auth.readonly,
    }[who]
    use_credentials(monkeypatch, key_id, secret)
    store = open_store(s3_server.url(auth.bucket, "results"))
    with pytest.raises(StorePermanentError) as info:
        store.put_bytes("m/result.json", b"{}")
    assert str(info.value).startswith(f"s3://{auth.bucket}/results: {message}")
    assert "\n" not in str(info.value)
    assert info.value.exit_code == EXIT_PERMANENT
    assert secret not in str(info.value)


@pytest.mark.parametrize(
    ("who", "message"),
    [
        pytest.param("unknown-key", "(InvalidAccessKeyId, HTTP 403)", id="unknown-key"),
        pytest.param("readonly", "access denied (AccessDenied, HTTP 403) trying to check the "
                     "bucket", id="policy-denies"),
    ],
)
def test_check_names_the_credential_problem(s3_server: S3Server, auth: Auth,
                                            monkeypatch: pytest.MonkeyPatch, who: str,
                                            message: str) -> None:
    """check() (run before any analysis) tells a bad key from a denying policy."""
    use_credentials(monkeypatch, *(("AKIAEXAMPLEUNKNOWN01", "x") if who == "unknown-key"
                                   else auth.readonly))
    with pytest.raises(StorePermanentError, match=re.escape(message)):
        open_store(s3_server.url(auth.bucket, "results")).check()


def test_no_credentials_is_permanent(s3_server: S3Server,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No keys anywhere in the chain: say how to provide them (exit 3), quickly (no IMDS)."""
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = open_store(s3_server.url("esd-any-bucket", "x"))
    t0 = time.perf_counter()
    with pytest.raises(StorePermanentError, match="no usable AWS credentials found: set "
                       "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"):
        store.put_bytes("m/result.json", b"{}")
    assert time.perf_counter() - t0 < 5


def test_unknown_profile_is_permanent(monkeypatch: pytest.MonkeyPatch,
                                      s3_server: S3Server) -> None:
    monkeypatch.setenv("AWS_PROFILE", "esd-no-such-profile")
    with pytest.raises(StorePermanentError, match="AWS profile 'esd-no-such-profile'"):
        open_store(s3_server.url("esd-any-bucket"))


def test_credentials_in_the_url_are_refused() -> None:
    with pytest.raises(UsageError) as info:
        open_store("s3://AKIAEXAMPLE:s3cr3t-b7e2@bucket/results")
    assert "s3cr3t-b7e2" not in str(info.value)


def test_throttling_is_retried_by_botocore(s3_server: S3Server,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two 503 SlowDown replies, then success: the put succeeds on the third attempt."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    store = make_store(s3_server)
    before = len(s3_server.requests)
    s3_server.fail_next(2, status=503, code="SlowDown")
    store.put_bytes("m/result.json", b"{}")
    assert [r[0] for r in s3_server.requests[before:]] == ["PUT"] * 3
    assert store.get_bytes("m/result.json") == b"{}"


@pytest.mark.parametrize(
    ("status", "code"),
    [
        pytest.param(503, "SlowDown", id="throttled"),
        pytest.param(500, "InternalError", id="internal-error"),
        pytest.param(503, "ServiceUnavailable", id="unavailable"),
    ],
)
def test_server_trouble_is_transient_after_retries(s3_server: S3Server,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   status: int, code: str) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    store = make_store(s3_server)
    s3_server.fail_next(2, status=status, code=code)
    with pytest.raises(StoreError) as info:
        store.put_bytes("m/result.json", b"{}")
    assert f"the store is busy or failing ({code}, HTTP {status})" in str(info.value)
    assert info.value.exit_code == EXIT_TRANSIENT


def test_unreachable_endpoint_is_transient(monkeypatch: pytest.MonkeyPatch,
                                           s3_server: S3Server) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    store = open_store("s3://esd-any-bucket/results")
    with pytest.raises(StoreError, match=f"cannot reach the store at {endpoint} "
                       r"\(EndpointConnectionError\)") as info:
        store.put_bytes("m/result.json", b"{}")
    assert info.value.exit_code == EXIT_TRANSIENT


# --- the worker end to end ------------------------------------------------------------------
#
# Each scenario is a real `esd-worker` process; they all start with the module's first test and
# run beside the in-process tests (seconds of imports each). They talk to servers of their own,
# so the faults injected above never reach them; `auth` waits for them, because moto's auth
# switch is process-wide.









@pytest.fixture(scope="module")
def s3_worker_runs(gpt2_dir: Path) -> Iterator[dict[str, WorkerRun]]:
    """The scenarios, by name:

    ok           a healthy server: layers.csv, eigs.npz, result.json (last).
    no-bucket    the bucket does not exist.
    unknown-key  a server that refuses every request as S3 refuses an unknown access key id
                 (moto's real signature checks are process-wide, so they are exercised
                 in-process above: test_bad_credentials_are_permanent).
    dying        a server that stops dead right after storing layers.csv.
    """
    healthy, refusing, dying = S3Server().start(), S3Server().start(), S3Server().start()
    refusing.fail_next(1000, status=403, code="InvalidAccessKeyId")
    dying.stop_after(lambda method, path: method == "PUT" and path.endswith("/" + LAYERS_NAME))
    runs = {
        "ok": start_worker(healthy, healthy.new_bucket(), gpt2_dir),
        "no-bucket": start_worker(healthy, "esd-no-such-bucket", gpt2_dir),
        "unknown-key": start_worker(refusing, "esd-any-bucket", gpt2_dir),
        "dying": start_worker(dying, healthy.new_bucket(), gpt2_dir),  # moto's state is shared
    }
    yield runs
    for run in runs.values():
        if run.proc.poll() is None:
            run.proc.kill()
        run.proc.communicate()
    for server in (healthy, refusing, dying):
        server.stop()


@pytest.fixture(scope="module", autouse=True)
def _start_worker_runs_early(request: pytest.FixtureRequest) -> None:
    """Start the worker runs with the module's first test when a selected test needs them."""
    if any("s3_worker_runs" in getattr(item, "fixturenames", ())
           for item in request.session.items if item.path == request.path):
        request.getfixturevalue("s3_worker_runs")


def marker_of(server: S3Server, run: WorkerRun) -> dict[str, object]:
    keys = [k for k in server.keys(run.bucket, PREFIX) if k.endswith("/" + MARKER_NAME)]
    assert len(keys) == 1, keys
    body = server.client().get_object(Bucket=run.bucket, Key=keys[0])["Body"].read()
    return dict(json.loads(body))


def test_worker_writes_its_results_to_s3(s3_worker_runs: dict[str, WorkerRun]) -> None:
    """layers.csv, eigs.npz and result.json under <prefix>/<model_key>/, the marker last."""
    run = s3_worker_runs["ok"].result()
    assert run.returncode == 0, run.stderr[-3000:]
    server = run.server
    marker = marker_of(server, run)
    key = marker["model_key"]
    assert sorted(server.keys(run.bucket)) == sorted(
        f"{PREFIX}/{key}/{name}" for name in (LAYERS_NAME, EIGS_NAME, MARKER_NAME)
    )
    puts = [path for method, path, _ in server.requests
            if method == "PUT" and path.startswith(f"/{run.bucket}/")]
    assert puts[-1] == f"/{run.bucket}/{PREFIX}/{key}/{MARKER_NAME}"
    assert marker["outputs"] == {"layers": LAYERS_NAME, "eigs": EIGS_NAME}
    layers = server.client().get_object(Bucket=run.bucket, Key=f"{PREFIX}/{key}/{LAYERS_NAME}")
    rows = layers_from_csv(layers["Body"].read())
    assert len(rows) == marker["layer_count"] == 9  # 2 blocks x 4 Conv1D + lm_head


@pytest.mark.parametrize("scenario", ["ok", "no-bucket", "unknown-key", "dying"])
def test_worker_never_prints_or_stores_the_secret(s3_worker_runs: dict[str, WorkerRun],
                                                  scenario: str) -> None:
    """Not in stdout, not in stderr (the runs use -v), not in any object written."""
    run = s3_worker_runs[scenario].result()
    assert run.secret not in run.stdout
    assert run.secret not in run.stderr
    if scenario in ("ok", "dying"):
        client = s3_worker_runs["ok"].server.client()
        for key in s3_worker_runs["ok"].server.keys(run.bucket):
            assert run.secret.encode() not in client.get_object(
                Bucket=run.bucket, Key=key)["Body"].read()


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        pytest.param("no-bucket", "s3://esd-no-such-bucket: bucket does not exist or is not "
                     "yours (NoSuchBucket, HTTP 404)", id="no-bucket"),
        pytest.param("unknown-key", "s3://esd-any-bucket/sweep/atlas: the access key id is not "
                     "known to the store (InvalidAccessKeyId, HTTP 403)", id="unknown-key"),
    ],
)
def test_worker_store_misconfiguration_exits_3(s3_worker_runs: dict[str, WorkerRun],
                                               scenario: str, message: str) -> None:
    """Retrying cannot help: exit 3 and one line saying what to fix."""
    run = s3_worker_runs[scenario].result()
    assert run.returncode == EXIT_PERMANENT, run.stderr[-3000:]
    assert len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr[-3000:]


def test_worker_exits_4_without_marker_when_the_store_dies(
    s3_server: S3Server, s3_worker_runs: dict[str, WorkerRun], gpt2_dir: Path,
) -> None:
    """Server gone after layers.csv: exit 4 (retry), no marker; the next run finishes."""
    run = s3_worker_runs["dying"].result()
    assert run.returncode == EXIT_TRANSIENT, run.stderr[-3000:]
    assert len(run.error_lines) == 1 and "cannot reach the store" in run.error_lines[0]
    keys = s3_server.keys(run.bucket)  # the dead server's objects, through the live one
    assert [k.rsplit("/", 1)[1] for k in keys] == [LAYERS_NAME]  # not done: no result.json

    from esd_worker.analysis.analyze import analyse_model
    from esd_worker.core.command.settings import WorkerSettings

    url = s3_server.url(run.bucket, PREFIX)
    marker = analyse_model(WorkerSettings(model=str(gpt2_dir), output=url, device="cpu"))
    assert marker_of(s3_server, run)["model_key"] == marker.model_key
