"""`esd-sweep report`: distribution plots, per-model pages and index.html from a results store.

The example store is made by the real worker (in this process, CPU) on three models: a tiny
GPT-2 (relation base), a LoRA adapter on it (adapter; adapter_config.json names the GPT-2
directory as its base) and the real all-MiniLM-L6-v2 (finetune: it is a fine-tune of
MiniLM-L6-H384). tests.support.results.example_results builds it once per session; the other
results tests use it too, each on a copy of its own. The parts have tests of their own:
test_reader, test_aggregates, test_overview, test_plots, test_html. The example store has
no results tables: the report reads its models through the tables' per-model fallback.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.errors import ResultsError
from controller.results import report
from controller.results.html import (
    ALPHA_PLOT,
    ESD_PLOT,
    INDEX_NAME,
    PAGE_NAME,
    VS_BASE_PLOT,
)
from controller.results.report import ReportSettings, write_report
from tests.support.results import (
    Links,
    copy_example,
    example_results,
    keys_by_relation,
    png_size,
    png_title,
    wired_subparser,
)


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory, gpt2_dir: Path) -> Path:
    master = example_results(tmp_path_factory, gpt2_dir)
    return copy_example(master, tmp_path_factory.mktemp("report") / "results")


@pytest.fixture(scope="module")
def written(example: Path) -> Path:
    """The report of the example store, in its default place <results>/report/."""
    write_report(ReportSettings(results=str(example)))
    return example / "report"


def test_report_writes_every_file(written: Path, example: Path) -> None:
    """The index and the 19 distribution plots (6 metrics x 3 groupings + layer α); a page
    with α and ESD plots for every listed model (all three: each is in some top 20; all have
    eigs.npz); the adapter-vs-base plot only for the adapter, whose base is in the store."""
    keys = keys_by_relation(example)
    assert (written / INDEX_NAME).is_file()
    assert len(list((written / "plots").glob("*.png"))) == 19
    for relation, key in keys.items():
        folder = written / "models" / key
        assert (folder / PAGE_NAME).is_file()
        assert (folder / ALPHA_PLOT).is_file()
        assert (folder / ESD_PLOT).is_file()
        assert (folder / VS_BASE_PLOT).is_file() == (relation == "adapter")


def _pngs(root: Path) -> list[Path]:
    return sorted(root.rglob("*.png"))


def test_plots_are_real_non_empty_pngs(written: Path) -> None:
    """Every plot is a PNG with a plausible size: at least 400 × 300 pixels at 100 dpi (the
    smallest figure is 7.5 × 4 inches) and more than 10 kB (an empty canvas is ~3 kB: axes,
    labels and lines make the rest). 19 distributions + 3 α + 3 ESD + 1 vs base = 26."""
    pngs = _pngs(written)
    assert len(pngs) == 26, pngs
    for path in pngs:
        data = path.read_bytes()
        width, height = png_size(data)
        assert width >= 400 and height >= 300, (path.name, width, height)
        assert width <= 2000 and height <= 2000, (path.name, width, height)
        assert len(data) > 10_000, (path, len(data))


def test_esd_plot_is_a_grid_of_the_chosen_layers(written: Path, example: Path) -> None:
    """The default ESD plot shows 6 layers in a 3 × 2 grid of 4.3 × 3.3-inch panels: about
    1290 × 710 pixels (plus the title row)."""
    path = written / "models" / keys_by_relation(example)["finetune"] / ESD_PLOT
    width, height = png_size(path.read_bytes())
    assert 1200 <= width <= 1400 and 650 <= height <= 800, (width, height)


def _links(page: Path) -> Links:
    links = Links()
    links.feed(page.read_text())
    return links


def test_index_references_existing_files(written: Path, example: Path) -> None:
    """Every link and image of index.html and of the model pages is relative and exists;
    every model of the store has a page linked from the index; the index shows the 19
    distribution plots, the pages their model's plots."""
    links = _links(written / INDEX_NAME)
    for ref in links.refs:
        assert "://" not in ref and not ref.startswith("/") and (written / ref).is_file(), ref
    pages = {f"models/{key}/{PAGE_NAME}" for key in keys_by_relation(example).values()}
    assert pages <= set(links.refs)
    assert len({r for r in links.refs if r.endswith(".png")}) == 19
    for page in pages:
        folder = (written / page).parent
        for ref in _links(written / page).refs:
            assert (folder / ref).resolve().is_file(), (page, ref)
    text = (written / INDEX_NAME).read_text()
    assert "3 models," in text and "_tables/models/" in text and "summary.csv" in text


def test_report_says_its_fit_and_leaves_the_band_out(written: Path) -> None:
    """The example is fitted with the default xmin_mid: the index and each model page say
    so near the top with the line why the 2–6 band is not shown; no band share column; the
    title of every PNG of α or a fitted metric ends with the fit, the others' do not."""
    label = "fit xmin_mid, float32"
    note = ("the 2–6 band is calibrated for the DKS fit; these α are xmin_mid: see "
            "docs/reading-alpha.md")
    index = (written / INDEX_NAME).read_text()
    assert f"Fit: <b>{label}</b>" in index[:index.index("<h2>")]
    assert note in index and "α in [2, 6]" not in index
    for page in (written / "models").glob(f"*/{PAGE_NAME}"):
        text = page.read_text()
        assert f"Fit: <b>{label}</b>" in text[:text.index("<table>")] and note in text
    for path in _pngs(written):
        title = png_title(path.read_bytes()) or ""
        fitted = path.parent.name != "plots" or path.name.startswith(("alpha", "layer_alpha"))
        assert title.endswith("\n" + label) is fitted, (path, title)


def test_max_model_plots_caps_per_model_plots_and_says_so(example: Path, tmp_path: Path) -> None:
    """With --max-model-plots 1 only the first model the index lists (the top alpha_mean)
    gets a page, and only it is linked; --out writes to another directory."""
    out = tmp_path / "site"
    result = write_report(ReportSettings(results=str(example), out=str(out),
                                         max_model_plots=1, esd_layers=2))
    assert result.plotted_models == 1 and result.models == 3
    assert len(list((out / "models").iterdir())) == 1
    links = _links(out / INDEX_NAME)
    assert len({r for r in links.refs if r.startswith("models/")}) == 1
    assert all((out / r).is_file() for r in links.refs)


def test_missing_location_is_one_line_usage_error(tmp_path: Path) -> None:
    """A results directory that does not exist: one line naming it, exit status 2."""
    with pytest.raises(ResultsError) as err:
        write_report(ReportSettings(results=str(tmp_path / "nope")))
    assert "\n" not in str(err.value) and "nope" in str(err.value)
    assert err.value.exit_code == 2


def test_store_without_results_is_one_line_usage_error(tmp_path: Path) -> None:
    with pytest.raises(ResultsError, match=r"no results in .*result\.json") as err:
        write_report(ReportSettings(results=str(tmp_path)))
    assert "\n" not in str(err.value)


def test_bad_settings_are_reported_together(tmp_path: Path) -> None:
    with pytest.raises(ResultsError) as err:
        write_report(ReportSettings(results=str(tmp_path), max_model_plots=-1, esd_layers=-2))
    assert "--max-model-plots" in str(err.value) and "--esd-layers" in str(err.value)


def test_unknown_tag_says_how_to_make_it(example: Path) -> None:
    with pytest.raises(ResultsError, match="esd-sweep refit --tag nothing-here"):
        write_report(ReportSettings(results=str(example), tag="nothing-here"))


def test_run_report_prints_where_the_index_is(
    example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The subcommand's flags (kebab-case and the old snake_case spellings) and its output."""
    parser = argparse.ArgumentParser()
    report.add_report_flags(parser)
    args = parser.parse_args(["--output_dir", str(example), "--out", str(tmp_path / "r"),
                              "--max-model-plots", "0"])
    assert report.run_report(args) == 0
    out = capsys.readouterr().out
    assert f"open {tmp_path / 'r' / INDEX_NAME}" in out
    assert not (tmp_path / "r" / "models").exists()


# ---------------------------------------------------------------------------------- S3


@pytest.fixture(scope="module")
def s3_server() -> Iterator[object]:
    from tests.support.s3server import serve_s3

    yield from serve_s3()


def test_report_reads_and_writes_s3(s3_server: object, example: Path) -> None:
    """The same report from an s3:// store (moto over HTTP): its files land under
    <prefix>/report/ in the bucket."""
    from tests.support.s3server import S3Server

    assert isinstance(s3_server, S3Server)
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    for path in example.rglob("*"):
        rel = path.relative_to(example).as_posix()
        if path.is_file() and not rel.startswith("report/"):
            client.put_object(Bucket=bucket, Key=f"results/{rel}", Body=path.read_bytes())
    result = write_report(ReportSettings(results=s3_server.url(bucket, "results"),
                                         max_model_plots=1, esd_layers=1))
    keys = set(s3_server.keys(bucket, "results/report/"))
    assert {f"results/report/{name}" for name in result.files} == keys
    assert f"results/report/{INDEX_NAME}" in keys


def test_unreachable_s3_store_is_a_store_error(s3_server: object) -> None:
    """A bucket that does not exist: the store's permanent error, which the CLI maps to
    exit 3 (store unreachable)."""
    from esd_worker.core.errors import StorePermanentError
    from tests.support.s3server import S3Server

    assert isinstance(s3_server, S3Server)
    with pytest.raises(StorePermanentError) as err:
        write_report(ReportSettings(results=s3_server.url("no-such-bucket-here", "results")))
    assert err.value.exit_code == 3


def test_cli_report(
    example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    """Through `esd-sweep report`: 0 and the index path; a missing location is one line on
    stderr and exit 2."""
    if wired_subparser("report", "--max-model-plots") is None:
        pytest.skip("esd-sweep report is not wired to controller.results.report yet")
    from controller.cli import main

    assert main(["report", "--output-dir", str(example), "--out", str(tmp_path / "r"),
                 "--max-model-plots", "0"]) == 0
    assert (tmp_path / "r" / INDEX_NAME).is_file()
    capsys.readouterr()
    assert main(["report", "--output-dir", str(tmp_path / "missing")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("esd-sweep: error:") and "missing" in err[0]
