"""One rule for what a model name means, applied alike by the list reader (the controller's
plan, a worker's --models), the worker's --model and the resolver
(esd_worker.core.models.naming): the same row gets the same key everywhere, and a hub-id-shaped
name that is also a folder here is read as the hub id, with a warning that says how to name
the folder."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from controller.cli import main as sweep_main
from esd_worker import cli
from esd_worker.core.echo import SHOWN_LINES
from esd_worker.core.models.modellist import ListFile, ModelRow
from esd_worker.core.models.naming import model_key, ref_key
from esd_worker.fetch.resolve import resolve_model
from esd_worker.serve.inbox import requests_from_list
from tests.support.builders import make_tensor_model
from tests.support.hub import HUB_REPO, HubCache

pytestmark = pytest.mark.usefixtures("restore_logging")


def _warning(name: str) -> str:
    return (f"{name} is read as a hub id although a folder of that name exists here; "
            f"write ./{name} to analyse the folder")


@pytest.fixture
def offline_hub(hub_cache: HubCache, monkeypatch: pytest.MonkeyPatch) -> HubCache:
    """huggingface_hub in this process reads the session's offline cache (HUB_REPO) only."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache.home / "hub"))
    return hub_cache


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory, holding a two-layer model in the folders `models/x` and
    HUB_REPO (a folder named like the hub repo in the cache, with other weights)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {f"blocks.{i}.proj.weight": torch.randn(24, 16, generator=gen) for i in range(2)}
    work = tmp_path / "work"
    make_tensor_model(work / "models" / "x", tensors)
    make_tensor_model(work / HUB_REPO, tensors)
    monkeypatch.chdir(work)
    return work


def _controller_row(work: Path, ref: str) -> ModelRow:
    (work / "list.csv").write_text(f"model_id\n{ref}\n")
    source = ListFile(work / "list.csv")
    try:
        (row,) = source.items()
    finally:
        source.close()
    assert isinstance(row, ModelRow), row
    return row


@pytest.mark.parametrize(
    ("spelling", "source"),
    [
        pytest.param("./models/x", "local", id="dot-slash"),
        pytest.param("{work}/models/x", "local", id="absolute"),
        pytest.param("{work}/models/./x/", "local", id="absolute-unnormalised"),
        pytest.param("./" + HUB_REPO, "local", id="the-folder-named-like-a-repo"),
        pytest.param(HUB_REPO, "hub", id="hub-id-that-is-also-a-folder"),
        pytest.param(HUB_REPO + "@{commit}", "hub", id="hub-id-at-a-commit"),
    ],
)
def test_resolve_the_list_and_the_worker_agree(
    offline_hub: HubCache, work: Path, tmp_path: Path, spelling: str, source: str
) -> None:
    """The key the controller's list reading gives a row, the key the worker computes for
    --model and the id and revision the resolver records are one: a hub id that is also a
    folder here is fetched from the hub (before: the folder, analysed under the hub key)."""
    ref = spelling.format(work=work, commit=offline_hub.commit)
    row = _controller_row(work, ref)
    args = cli.build_parser().parse_args(["--model", ref, "--output", str(tmp_path / "o")])
    worker_key = ref_key(cli.settings_from_args(args).model)  # as analyse_model keys it
    resolved = resolve_model(ref)
    assert resolved.source == source
    assert row.key == worker_key == model_key(resolved.model_id, resolved.revision)
    if source == "hub":
        assert resolved.resolved_revision == offline_hub.commit
        assert not resolved.directory.is_relative_to(work)
    else:
        assert resolved.directory.is_relative_to(work)


def test_the_worker_warns_and_reads_a_hub_id(
    capsys: pytest.CaptureFixture[str], offline_hub: HubCache, work: Path, tmp_path: Path
) -> None:
    """`--model models/x` with a folder models/x here: one warning naming the fix, then the
    hub id is looked up (not in the offline cache: exit 3), and the folder is not analysed."""
    out = tmp_path / "out"
    code = cli.main(["--device", "cpu", "--model", "models/x", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.count(_warning("models/x")) == 1
    assert "models/x is not in the HF cache" in err
    assert not list(out.rglob("result.json"))


def test_a_folder_written_as_a_path_gets_no_warning(
    capsys: pytest.CaptureFixture[str], work: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code = cli.main(["--device", "cpu", "--model", "./models/x", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "read as a hub id" not in err
    assert (out / model_key(str(work / "models" / "x")) / "result.json").is_file()


def test_the_controller_warns_once_per_name_and_caps_the_lines(
    capsys: pytest.CaptureFixture[str], work: Path, tmp_path: Path
) -> None:
    """`esd-sweep status` reads the list: each hub-id row that is also a folder here is
    warned of once (a duplicate is the same name), the first SHOWN_LINES of them, then one
    line counting the rest; `./models/x` and hub ids with no folder are not."""
    extra = [f"org/m{i}" for i in range(SHOWN_LINES + 3)]
    for name in extra:
        (work / name).mkdir(parents=True)
    rows = ["models/x", "models/x", "./models/x", "org/not-a-folder", *extra]
    models = work / "list.csv"
    models.write_text("model_id\n" + "\n".join(rows) + "\n")
    code = sweep_main(["status", "--model-list", str(models), "--output-dir",
                       str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err
    warned = [line for line in err.splitlines() if "is read as a hub id" in line]
    assert len(warned) == SHOWN_LINES
    assert _warning("models/x") in warned[0] and err.count(_warning("models/x")) == 1
    assert "org/not-a-folder" not in err and "write ././models/x" not in err
    assert "… and 4 more hub id(s) that are also folders here not shown" in err


def test_a_workers_list_warns_too(caplog: pytest.LogCaptureFixture, work: Path) -> None:
    """`esd-worker --models FILE` reads its list the same way: the hub id is queued as the
    hub id, with the same warning."""
    models = work / "list.csv"
    models.write_text("model_id\nmodels/x\n./models/x\n")
    with caplog.at_level(logging.WARNING):
        requests = requests_from_list(str(models))
    assert [r.model for r in requests] == ["models/x", str(work / "models" / "x")]
    assert [r.message for r in caplog.records] == [_warning("models/x")]
