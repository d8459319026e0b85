"""`esd-sweep compare`: per-layer differences between two results locations or two tables.

Runs on a copy of tests.support.results.example_results (the worker on a tiny GPT-2, a LoRA
adapter on it, and the real all-MiniLM-L6-v2) and on refits of it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest

from controller.errors import ResultsError
from controller.results import compare
from controller.results.compare import CompareSettings, compare_results, diff_columns, parse_pair
from controller.results.refit import RefitSettings, refit_store
from controller.results.tables import read_done_models
from esd_worker.core.powerlaw import layer_metrics
from esd_worker.core.store.results import eigs_from_npz, layers_from_csv
from esd_worker.core.store.stores import LocalStore
from esd_worker.core.store.tables import write_parts
from tests.support.results import copy_example, example_results, keys_by_relation

NORMS = ("spectral_norm", "log_spectral_norm", "stable_rank", "entropy", "log_norm")
MID, DKS = "mid", "dks"


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory, gpt2_dir: Path) -> Path:
    """A copy of the example with two refits: tags "mid" (the original settings) and "dks"."""
    master = example_results(tmp_path_factory, gpt2_dir)
    root = copy_example(master, tmp_path_factory.mktemp("compare") / "results")
    refit_store(RefitSettings(results=str(root), tag=MID))
    refit_store(RefitSettings(results=str(root), fix_fingers="DKS", tag=DKS))
    return root


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def test_two_refits_give_the_expected_deltas(example: Path, tmp_path: Path) -> None:
    """A = the xmin_mid refit, B = the DKS refit of the same store: every model pairs with
    itself, every layer matches by name, and alpha_delta is layer_metrics' DKS α minus its
    xmin_mid α on the layer's stored eigenvalues (computed here directly). The norm
    metrics do not depend on the fit: their deltas are exactly 0."""
    out = tmp_path / "diff.csv"
    result = compare_results(CompareSettings(a=str(example), tag_a=MID, tag_b=DKS, out=out))
    keys = sorted(keys_by_relation(example).values())
    assert [(a.key, b.key) for a, b in result.pairs] == [(k, k) for k in keys]
    rows = _rows(out)
    assert list(rows[0]) == list(diff_columns(compare.DEFAULT_METRICS))
    by_key: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        by_key.setdefault(row["model_key_a"], []).append(row)
    for key in keys:
        eigs = eigs_from_npz((example / key / "eigs.npz").read_bytes())
        table = layers_from_csv((example / key / "layers.csv").read_bytes())
        assert [r["layer"] for r in by_key[key]] == [r["layer"] for r in table]
        for row, layer in zip(by_key[key], table, strict=True):
            max_dim = max(int(layer["M"]), int(layer["N"]))
            mid = layer_metrics(eigs[layer["layer"]], max_dim=max_dim, fix_fingers="xmin_mid")
            dks = layer_metrics(eigs[layer["layer"]], max_dim=max_dim, fix_fingers="DKS")
            assert float(row["alpha_a"]) == mid["alpha"]
            assert float(row["alpha_b"]) == dks["alpha"]
            assert float(row["alpha_delta"]) == float(dks["alpha"]) - float(mid["alpha"])
            assert int(row["num_pl_spikes_delta"]) == \
                int(dks["num_pl_spikes"]) - int(mid["num_pl_spikes"])
            for m in NORMS:
                assert float(row[f"{m}_delta"]) == 0.0, m


def test_same_table_compares_each_adapter_with_its_base(example: Path) -> None:
    """One location, one table: the adapter (B) pairs with its base (A) found through its
    marker's base_model, so delta = adapter − base. The LoRA targets c_attn and c_proj
    (attn.c_proj and mlp.c_proj match): those layers' spectra change; mlp.c_fc and lm_head
    are the base's own weights, so every delta there is exactly 0."""
    keys = keys_by_relation(example)
    result = compare_results(CompareSettings(a=str(example)))
    assert [(a.key, b.key) for a, b in result.pairs] == [(keys["base"], keys["adapter"])]
    for row in result.rows:
        touched = row["layer"].endswith((".c_attn", ".c_proj"))
        deltas = [row[f"{m}_delta"] for m in ("alpha", *NORMS)]
        if touched:
            assert row["spectral_norm_delta"] != 0.0, row["layer"]
        else:
            assert deltas == [0.0] * len(deltas), row["layer"]
    # 2 blocks × (attn.c_attn, attn.c_proj, mlp.c_proj)
    assert sum(row["layer"].endswith((".c_attn", ".c_proj")) for row in result.rows) == 6


def test_two_locations_match_models_by_key(example: Path, tmp_path: Path) -> None:
    """A and a copy of it: the same keys pair up and every delta is 0."""
    copy = tmp_path / "copy"
    shutil.copytree(example, copy)
    result = compare_results(CompareSettings(a=str(example), b=str(copy)))
    assert len(result.pairs) == 3
    assert all(row["alpha_delta"] == 0.0 or math.isnan(row["alpha_delta"])
               for row in result.rows)


def test_explicit_pair_across_locations_keeps_unmatched_layers(
    example: Path, tmp_path: Path
) -> None:
    """--pair GPT2_KEY:MINILM_KEY: no layer names in common, so every row has one side
    empty (status None, values NaN, delta NaN), A's layers first; nothing is dropped."""
    keys = keys_by_relation(example)
    copy = tmp_path / "copy"
    shutil.copytree(example, copy)
    out = tmp_path / "pair.csv"
    result = compare_results(CompareSettings(
        a=str(example), b=str(copy), pairs=((keys["base"], keys["finetune"]),),
        metrics=("alpha",), out=out))
    n_a = len(layers_from_csv((example / keys["base"] / "layers.csv").read_bytes()))
    n_b = len(layers_from_csv((copy / keys["finetune"] / "layers.csv").read_bytes()))
    assert len(result.rows) == n_a + n_b
    assert all(math.isnan(r["alpha_delta"]) for r in result.rows)
    rows = _rows(out)
    assert rows[0]["status_b"] == "" and rows[0]["alpha_b"] == "" and rows[0]["alpha_a"]
    assert rows[-1]["status_a"] == "" and rows[-1]["alpha_b"]


def test_format_comparison_is_a_short_table(example: Path) -> None:
    result = compare_results(CompareSettings(a=str(example), tag_a=MID, tag_b=DKS))
    text = compare.format_comparison(result)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["A", "B", "layers"]
    assert len(lines) == 1 + 3 + 1 and lines[-1] == "Δ = B − A"
    assert "pooler.dense" in text or "max |Δalpha|" in text


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        pytest.param({"tag_b": "no-such-tag"}, "no layers.no-such-tag.csv", id="missing-tag"),
        pytest.param({"metrics": ("alpha", "beauty")}, "unknown beauty", id="bad-metric"),
        pytest.param({"pairs": (("a-key", "b-key"),)}, "no result for model key",
                     id="unknown-pair-keys"),
    ],
)
def test_errors_are_one_line(example: Path, settings: dict[str, object], message: str) -> None:
    with pytest.raises(ResultsError, match=message) as err:
        compare_results(CompareSettings(a=str(example), **settings))  # type: ignore[arg-type]
    assert "\n" not in str(err.value) and err.value.exit_code == 2


def test_no_common_model_says_how_to_pair(example: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    keys = keys_by_relation(example)
    shutil.copytree(example / keys["base"], other / keys["base"])
    (other / keys["base"] / "result.json").rename(other / keys["base"] / "moved.json")
    shutil.copytree(example / keys["finetune"], other / "x-0123456789")
    marker = other / "x-0123456789" / "result.json"  # a model of its own: its folder's key
    marker.write_text(json.dumps(json.loads(marker.read_text()) | {"model_key": "x-0123456789"}))
    with pytest.raises(ResultsError, match="--pair A_KEY:B_KEY"):
        compare_results(CompareSettings(a=str(example), b=str(other)))


def test_missing_location_is_named(tmp_path: Path) -> None:
    with pytest.raises(ResultsError, match="no such directory"):
        compare_results(CompareSettings(a=str(tmp_path / "a"), b=str(tmp_path / "b")))


@pytest.mark.parametrize("text", ["nokey", ":b", "a:", "a:b:c"])
def test_bad_pair_syntax(text: str) -> None:
    with pytest.raises(ResultsError, match="A_KEY:B_KEY"):
        parse_pair(text)


def test_run_compare_flags(
    example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    compare.add_compare_flags(parser)
    out = tmp_path / "d.csv"
    args = parser.parse_args([str(example), "--tag_a", MID, "--tag-b", DKS,
                              "--metrics", "alpha,log_norm", "--out", str(out)])
    assert compare.run_compare(args) == 0
    printed = capsys.readouterr().out
    assert f"in {out}" in printed
    assert list(_rows(out)[0]) == list(diff_columns(("alpha", "log_norm")))


def test_cli_compare(
    example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    """Through `esd-sweep compare`: 0 with the table printed; a bad --pair is one line on
    stderr and exit 2."""
    from tests.support.results import wired_subparser

    if wired_subparser("compare", "--pair") is None:
        pytest.skip("esd-sweep compare is not wired yet")
    from controller.cli import main

    assert main(["compare", str(example), "--tag-a", MID, "--tag-b", DKS]) == 0
    assert "Δ = B − A" in capsys.readouterr().out
    assert main(["compare", str(example), "--pair", "nocolon"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "A_KEY:B_KEY" in err[0]


def test_out_never_writes_through_a_planted_link(example: Path, tmp_path: Path) -> None:
    """--out FILE.csv in a folder others may write: a symlink planted at its name is
    replaced by the table, and the file it names keeps its bytes (before: the table was
    written through the link, over that file)."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the victim's own file\n")
    out = tmp_path / "shared" / "diff.csv"
    out.parent.mkdir()
    out.symlink_to(victim)
    compare_results(CompareSettings(a=str(example), tag_a=MID, tag_b=DKS, out=out))
    assert victim.read_bytes() == b"the victim's own file\n"
    assert not out.is_symlink()
    assert list(_rows(out)[0]) == list(diff_columns(compare.DEFAULT_METRICS))


def _with_tables(root: Path, tabled: bool) -> Path:
    """The store with its results tables (every model in a part) or without any."""
    shutil.rmtree(root / "_tables", ignore_errors=True)
    if tabled:
        store = LocalStore(root)
        write_parts(store, read_done_models(store, sorted(keys_by_relation(root).values())))
    return root


@pytest.mark.parametrize("how", ["adapters", "locations", "pair"])
def test_the_tables_give_the_same_differences(example: Path, tmp_path: Path, how: str) -> None:
    """The same comparison read from the results tables (model rows, then the layers of the
    paired models only) and from every model's files: the same pairs and the same CSV."""
    keys = keys_by_relation(example)
    out: dict[bool, bytes] = {}
    for tabled in (False, True):
        a = _with_tables(shutil.copytree(example, tmp_path / f"a-{tabled}"), tabled)
        b = _with_tables(shutil.copytree(example, tmp_path / f"b-{tabled}"), tabled)
        settings = {
            "adapters": CompareSettings(a=str(a)),
            "locations": CompareSettings(a=str(a), b=str(b)),
            "pair": CompareSettings(a=str(a), b=str(b),
                                    pairs=((keys["base"], keys["adapter"]),)),
        }[how]
        path = tmp_path / f"{how}-{tabled}.csv"
        result = compare_results(dataclasses.replace(settings, out=path))
        assert result.pairs and result.rows
        out[tabled] = path.read_bytes()
    assert out[True] == out[False]
