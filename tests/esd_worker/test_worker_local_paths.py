"""`esd-worker --model DIR`: a local model is keyed and recorded by its absolute path, as a
model list's row is, so the worker alone and the controller agree on what is done."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from esd_worker import cli
from esd_worker.core.models.modellist import make_single
from esd_worker.core.models.naming import model_key
from tests.support.builders import make_tensor_model, read_result

pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.fixture
def work_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """<tmp>/work holding a two-layer model `m`, and the working directory."""
    work = tmp_path / "work"
    gen = torch.Generator().manual_seed(0)
    make_tensor_model(work / "m", {f"blocks.{i}.proj.weight": torch.randn(24, 16, generator=gen)
                                   for i in range(2)})
    monkeypatch.chdir(work)
    return work


@pytest.mark.parametrize(
    "spelling",
    [
        pytest.param("./m", id="relative"),
        pytest.param("./m/", id="relative-trailing-slash"),
        pytest.param("{work}/m/", id="absolute-trailing-slash"),
        pytest.param("/{work}/m", id="double-leading-slash"),
    ],
)
def test_every_spelling_of_a_directory_is_one_model(
    capsys: pytest.CaptureFixture[str], work_dir: Path, tmp_path: Path, spelling: str
) -> None:
    """The result is under the key of the absolute path, the one the controller computes
    for the same row, and the marker names the directory (not `./m`, which says nothing of
    where it was run)."""
    out = tmp_path / "out"
    code = cli.main(["--device", "cpu", "--model", spelling.format(work=work_dir),
                     "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    absolute = str(work_dir / "m")
    (row,) = make_single(spelling.format(work=work_dir)).rows
    assert row.key == model_key(absolute)
    marker = read_result(out, row.key).marker
    assert (marker["model"], marker["model_id"], marker["model_key"]) == (
        absolute, absolute, row.key)


@pytest.mark.parametrize("flag", ["--model", "--base-model"])
def test_a_dotdot_out_of_a_symlink_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], work_dir: Path, tmp_path: Path, flag: str
) -> None:
    """`./link/../m` with link → <tmp>/elsewhere/deep is <tmp>/elsewhere/m to the OS, a
    different model from the <work>/m its text names: exit 2 before anything is read or
    written, one line naming the link."""
    deep = tmp_path / "elsewhere" / "deep"
    deep.mkdir(parents=True)
    make_tensor_model(tmp_path / "elsewhere" / "m", {"w": torch.ones(4, 4)})
    (work_dir / "link").symlink_to(deep)
    args = (["--model", "./link/../m"] if flag == "--model"
            else ["--model", "./m", "--relation", "adapter", "--base-model", "./link/../m"])
    out = tmp_path / "out"
    code = cli.main(["--device", "cpu", *args, "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{flag} " in err and "steps out of the symlink" in err and "/work/link" in err
    assert not out.exists()
