"""The report shows untrusted text safely. What a failure record or a model carries (an HF
token, an AWS key pair, a URL's password, the live HF_TOKEN value, terminal escapes) reaches
report/index.html redacted and escaped, the record read from a folder store and from S3
(moto); and `<`, `&`, `"`, `'` in a model id (a local path may hold them) or an error text are
HTML-escaped wherever the report shows them: the index's top / bottom / outlier lists, a
model page's heading, the failures table's examples and causes."""

from __future__ import annotations

import html.parser
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import esd_sweep
import esd_worker.core.redact as redact_module
from controller.results.html import ALPHA_PLOT, INDEX_NAME, MODELS_FOLDER, PAGE_NAME
from controller.results.report import ReportSettings, write_report
from esd_worker.core.store.layout import failure_key, write_model_result
from esd_worker.core.store.marker import Marker
from esd_worker.core.store.records import RECORD_SCHEMA, FailureRecord, write_failure
from esd_worker.core.store.results import layers_to_csv
from esd_worker.core.store.stores import LocalStore, Store
from tests.support.results import png_title
from tests.support.s3server import S3Server, make_store, serve_s3

# --- the secrets and escapes a hostile (or old) record holds -------------------------------

HF = "hf_" + "Zq9x" * 9  # the shape of an HF user token
KEY_ID = "AKIA" + "Q7ZB3XK2LMNP4RST"  # an AWS access key id
KEY_SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY"  # its secret
PASSWORD = "S3cretPassw0rd"
LIVE = "liveTokenValue-0123456789"  # no token shape: only HF_TOKEN says it is a secret
SECRETS = (HF, KEY_ID, KEY_SECRET, PASSWORD, LIVE)
# OSC (retitle the terminal, ended by BEL), CSI (red; clear the screen), a lone BEL
ESCAPES = "\x1b]0;pwned\x07\x1b[31mred\x1b[0m\x1b[2J\x07"
CONTROL = ("\x1b", "\x07")
HOSTILE_ERROR = (f"TransientError: download from https://alice:{PASSWORD}@hub.example/org/m "
                 f"failed; token={HF} aws_access_key_id={KEY_ID} "
                 f"aws_secret_access_key={KEY_SECRET} HF_TOKEN={LIVE} {ESCAPES}")
HOSTILE_MODEL = f"org/leaky-{HF}{ESCAPES}"


def marker(key: str, model_id: str, architecture: str) -> Marker:
    return Marker(model=model_id, model_key=key, model_id=model_id, architecture=architecture,
                  finished_at="2026-01-01", timings={"total_s": 1},
                  parameters={"evals_thresh": 1e-5})


def add_model(store: Store, key: str, model_id: str, alpha: float, *,
              architecture: str = "LlamaForCausalLM") -> None:
    """A done model as its per-model files (marker and layer table), 2 layers of `alpha`."""
    rows = [{"layer": f"h.{j}.mlp", "M": 8, "N": 16, "num_params": 128, "alpha": alpha,
             "status": "ok"} for j in range(2)]
    write_model_result(store, marker(key, model_id, architecture), layers=layers_to_csv(rows))


def put_raw_record(store: Store, key: str, *, model: str, error: str) -> None:
    """A failure record as a writer that redacts nothing would leave it (FailureRecord.to_json
    redacts: an old version's or a hostile worker's record does not)."""
    doc = {"schema": RECORD_SCHEMA, "model": model, "model_key": key, "error": error,
           "exit_code": 3, "signal": None, "retryable": True, "attempts": 1,
           "stderr_tail": [error], "run_id": "r", "time": "t"}
    store.put_bytes(failure_key(key), json.dumps(doc).encode())


def report_of(results: str, out: Path, *, pages: int = 0) -> str:
    write_report(ReportSettings(results=results, out=str(out), max_model_plots=pages,
                                esd_layers=1, threads=2))
    return (out / INDEX_NAME).read_text(encoding="utf-8")


def section(page: str, start: str, end: str | None = None) -> str:
    """The page from the heading `start` to the heading `end` (or the page's end)."""
    tail = page[page.index(start):]
    return tail[:tail.index(end)] if end else tail


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    yield from serve_s3()


@pytest.fixture(params=["folder", "s3"])
def store_at(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Store, str]:
    """A store and the URL the report reads it by: a folder, or a fresh bucket on moto."""
    if request.param == "folder":
        return LocalStore(tmp_path / "store"), str(tmp_path / "store")
    store = make_store(request.getfixturevalue("s3_server"))
    return store, store.url


@pytest.fixture
def live_token(monkeypatch: pytest.MonkeyPatch) -> str:
    """HF_TOKEN set in this process, and the process-wide redactor built anew (it reads the
    secret variables once, on first use, as a command does after it starts)."""
    monkeypatch.setenv("HF_TOKEN", LIVE)
    monkeypatch.setattr(redact_module, "_default", None)
    return LIVE


def test_a_records_secrets_and_escapes_never_reach_the_report(
        store_at: tuple[Store, str], tmp_path: Path, live_token: str) -> None:
    """A record read from the store holds a URL's password, an HF token, an AWS key pair, the
    HF_TOKEN value and OSC / CSI / BEL sequences, in its error and its model id: the index
    holds none of them, shows them redacted and the escapes as text, and still names the
    cause and the model."""
    store, url = store_at
    add_model(store, "m00001", "org/fine", 3.0)
    put_raw_record(store, "leaky0001", model=HOSTILE_MODEL, error=HOSTILE_ERROR)
    page = report_of(url, tmp_path / "site")
    for secret in SECRETS:
        assert secret not in page, secret
    for char in CONTROL:
        assert char not in page, repr(char)
    failures = section(page, "<h2>Failures</h2>")
    assert "1 failure record(s)" in failures
    assert "TransientError: download from https://[REDACTED]@hub.example/org/m" in failures
    assert "token=hf_[REDACTED]" in failures and "HF_TOKEN=[REDACTED]" in failures
    assert "aws_secret_access_key=[REDACTED]" in failures and "AKIA[REDACTED]" in failures
    assert "\\x1b]0;pwned\\x07\\x1b[31mred" in failures  # shown, not played
    assert "org/leaky-hf_[REDACTED]\\x1b]0;pwned" in failures


def test_records_differing_only_in_a_secret_are_one_group(tmp_path: Path) -> None:
    """The groups are made of the redacted texts: two records whose errors differ only in a
    token are one cause with two models, not two causes each showing its token."""
    store = LocalStore(tmp_path / "store")
    add_model(store, "m00001", "org/fine", 3.0)
    for n, token in enumerate(("hf_" + "A1b2" * 9, "hf_" + "C3d4" * 9)):
        put_raw_record(store, f"bad{n}", model=f"org/bad{n}",
                       error=f"TransientError: hub said 401 for {token}")
    failures = section(report_of(str(tmp_path / "store"), tmp_path / "site"),
                       "<h2>Failures</h2>")
    assert failures.count("hub said 401 for hf_[REDACTED]</td>") == 1
    assert "<td>2</td>" in failures and "org/bad0, org/bad1" in failures


# matplotlib warns of a glyph it cannot draw: a control character that reached a plot
@pytest.mark.filterwarnings("error:Glyph .* missing from font")
def test_a_models_secrets_and_escapes_never_reach_its_page_the_lists_or_the_plots(
        tmp_path: Path, live_token: str) -> None:
    """A model whose id (a local path) holds a token, the HF_TOKEN value and escapes, and
    whose config.json's architecture (its family) holds escapes: the index (lists, family
    tables), the model's page (title, heading, fields) and its plot's title hold none of
    them, and show the escapes as text."""
    store = LocalStore(tmp_path / "store")
    add_model(store, "leaky0001", f"/data/{HF}/{LIVE}\x1b[31m\x07", 30.0,
              architecture=f"Evil{ESCAPES}ForCausalLM")
    add_model(store, "m00001", "org/fine", 3.0)
    site = tmp_path / "site"
    index = report_of(str(tmp_path / "store"), site, pages=1)
    folder = site / MODELS_FOLDER / "leaky0001"
    page = (folder / PAGE_NAME).read_text(encoding="utf-8")
    title = png_title((folder / ALPHA_PLOT).read_bytes()) or ""
    for text in (index, page, title):
        for secret in SECRETS:
            assert secret not in text, secret
        for char in CONTROL:
            assert char not in text, repr(char)
    assert "/data/hf_[REDACTED]/[REDACTED]\\x1b[31m\\x07</a>" in index  # the lists: whole id
    assert "<h1>hf_[REDACTED]/[REDACTED]\\x1b[31m\\x07</h1>" in page  # its short name
    assert "evil\\x1b]0;pwned" in index and "Evil\\x1b]0;pwned" in page
    assert title.startswith("hf_[REDACTED]/[REDACTED]\\x1b[31m\\x07: α per layer")


# --- `<`, `&`, `"`, `'` through a model id and an error text ---------------------------------

MARKUP = "a<b&\"c'd"
HOSTILE_ID = f"/data/models/{MARKUP}"  # a local model directory holding markup characters
HOSTILE_KEY = "hostile0001"
MARKUP_ERROR = f"PermanentModelError: config.json says <script>&\"'{MARKUP}"
LISTS = ("Top 20", "Bottom 20", "Outliers (|robust z| > 5)")


class Cells(html.parser.HTMLParser):
    """The text of each table cell and heading of a page, as a browser shows it (entities
    decoded), each with the h4 heading it stands under."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[tuple[str, str]] = []  # (h4 heading, text)
        self.headings: list[str] = []  # h1 text
        self._h4 = ""
        self._tag: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("td", "h1", "h4"):
            self._tag, self._text = tag, []

    def handle_endtag(self, tag: str) -> None:
        if tag != self._tag:
            return
        text = "".join(self._text)
        if tag == "h4":
            self._h4 = text
        elif tag == "h1":
            self.headings.append(text)
        else:
            self.cells.append((self._h4, text))
        self._tag = None

    def handle_data(self, data: str) -> None:
        if self._tag is not None:
            self._text.append(data)


def cells_of(page: str) -> Cells:
    parser = Cells()
    parser.feed(page)
    return parser


@pytest.fixture(scope="module")
def markup_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A report of 12 ordinary models (α near 3) and one whose id is HOSTILE_ID (α 30: first
    of the top list, last of the bottom list, an outlier; the one model with a page), and a
    failure record of a model with that id and an error holding markup."""
    root = tmp_path_factory.mktemp("markup")
    store = LocalStore(root / "store")
    for i in range(12):
        add_model(store, f"m{i:05d}", f"org/m{i}", 3.0 + 0.01 * i)
    add_model(store, HOSTILE_KEY, HOSTILE_ID, 30.0)
    write_failure(store, FailureRecord(
        model=HOSTILE_ID, model_key="hostile0002", error=MARKUP_ERROR, exit_code=3,
        signal=None, retryable=False, attempts=1, stderr_tail=(), run_id="r", time="t"))
    report_of(str(root / "store"), root / "site", pages=1)
    return root / "site"


@pytest.mark.parametrize("title", LISTS, ids=["top", "bottom", "outliers"])
def test_a_model_id_with_markup_is_escaped_in_the_index_lists(
        markup_report: Path, title: str) -> None:
    """Each list shows the id as written (the browser decodes the escapes back to it), and
    the raw id, which would open a tag, is nowhere in the lists."""
    page = (markup_report / INDEX_NAME).read_text(encoding="utf-8")
    lists = section(page, "<h2>Top, bottom and outliers</h2>", "<h2>Failures</h2>")
    assert MARKUP not in lists
    shown = [text for h4, text in cells_of(lists).cells if h4 == title]
    assert HOSTILE_ID in shown, shown


def test_a_model_id_with_markup_is_escaped_in_its_pages_heading(markup_report: Path) -> None:
    page = (markup_report / MODELS_FOLDER / HOSTILE_KEY / PAGE_NAME).read_text(encoding="utf-8")
    body = page[page.index("<body>"):]
    assert MARKUP not in body
    assert cells_of(body).headings == [f"models/{MARKUP}"]


def test_markup_in_a_record_is_escaped_in_the_failures_table(markup_report: Path) -> None:
    """The cause (the record's error) and the examples (its model id) are shown as written,
    neither as markup."""
    page = (markup_report / INDEX_NAME).read_text(encoding="utf-8")
    failures = section(page, "<h2>Failures</h2>")
    assert MARKUP not in failures and "<script>" not in failures
    texts = [text for _, text in cells_of(failures).cells]
    assert MARKUP_ERROR in texts and HOSTILE_ID in texts, texts


def test_the_python_apis_failures_show_a_records_text_as_every_output_does(
        store_at: tuple[Store, str], live_token: str) -> None:
    """esd_sweep.load().failures() is an output too: a record's error, model id and last log
    line come out redacted with their escapes as text, in a folder and in S3."""
    store, url = store_at
    put_raw_record(store, "leaky0001", model=HOSTILE_MODEL, error=HOSTILE_ERROR)
    (row,) = esd_sweep.load(url).failures().to_dict("records")
    shown = " ".join(str(row[c]) for c in ("model_id", "error", "last_error"))
    for secret in SECRETS:
        assert secret not in shown, secret
    for char in CONTROL:
        assert char not in shown, repr(char)
    assert row["model_id"].startswith("org/leaky-hf_[REDACTED]\\x1b]0;pwned")
    assert "HF_TOKEN=[REDACTED]" in row["last_error"]
