"""esd_sweep.analyze: a model in memory, a folder, a hub id (through the local hub double) and
an adapter give the worker's own numbers as a typed DataFrame with WeightWatcher's columns,
and the caller's model is never modified."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import esd_sweep  # noqa: E402
from esd_worker.core.errors import UsageError  # noqa: E402
from tests.support import REPO_ROOT  # noqa: E402
from tests.support.builders import make_lora_adapter, run_analysis  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def _worker_rows(model: Path, tmp_path: Path, **settings: object) -> pd.DataFrame:
    """The worker's own layers.csv for the same model and settings."""
    result = run_analysis(model, tmp_path / "worker", **settings)
    return pd.DataFrame(result.rows)


def test_a_folder_gives_the_workers_numbers(llama_dir: Path, tmp_path: Path) -> None:
    frame = esd_sweep.analyze(llama_dir, device="cpu")
    worker = _worker_rows(llama_dir, tmp_path)
    assert list(frame["layer"]) == list(worker["layer"])
    np.testing.assert_array_equal(frame["alpha"].to_numpy(),
                                  worker["alpha"].astype(float).to_numpy())
    assert frame["alpha"].dtype == np.float64 and str(frame["M"].dtype) == "Int64"
    assert frame.attrs["fit"] == "fit xmin_mid, float32"


def test_a_module_in_memory_is_analysed_as_its_saved_folder_and_left_untouched(
        llama_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    frame = esd_sweep.analyze(model, device="cpu", fix_fingers="DKS")
    saved = esd_sweep.analyze(llama_dir, device="cpu", fix_fingers="DKS")
    assert list(frame["longname"]) == list(saved["longname"])
    np.testing.assert_allclose(frame["alpha"], saved["alpha"], rtol=1e-12)
    assert set(frame["layer_type"]) == {"Linear"}
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_state_dict_is_analysed_by_its_tensor_names(llama_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    frame = esd_sweep.analyze(model.state_dict(), device="cpu")
    module = esd_sweep.analyze(model, device="cpu")
    # By names: the norms and embeddings are left out, the same projections analysed.
    assert set(frame["layer"]) == set(module["layer"])
    assert set(frame["layer_type"]) == {"Matrix"}


def test_an_adapter_is_merged_into_its_base_in_memory(llama_dir: Path, tmp_path: Path) -> None:
    adapter = make_lora_adapter(llama_dir, tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    in_memory = esd_sweep.analyze(base, adapter=adapter, device="cpu")
    on_disk = esd_sweep.analyze(llama_dir, adapter=adapter, device="cpu")
    worker = _worker_rows(adapter, tmp_path, base_model=str(llama_dir), relation="adapter")
    np.testing.assert_allclose(on_disk["alpha"], worker["alpha"].astype(float), rtol=1e-12)
    np.testing.assert_allclose(in_memory["alpha"], on_disk["alpha"], rtol=1e-12)
    plain = esd_sweep.analyze(llama_dir, device="cpu")
    assert not np.allclose(plain["alpha"], on_disk["alpha"])  # the adapter changed them


def test_a_hub_id_is_downloaded_from_the_hub(llama_dir: Path, tmp_path: Path) -> None:
    """A notebook's process against the hub double (HF_ENDPOINT): the hub id's files are
    fetched over HTTP and analysed as the folder they came from."""
    from tests.support.hubserver import HubServer

    script = ("import esd_sweep; f = esd_sweep.analyze('esd-test/llama', device='cpu'); "
              "print(repr(f['alpha'].tolist()))")
    with HubServer() as hub:
        hub.add_repo("esd-test/llama", llama_dir)
        done = subprocess.run([sys.executable, "-c", script], env=hub.env(tmp_path / "hf"),
                              capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        assert hub.calls(kind="file"), "nothing was downloaded"
    alphas = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(alphas, esd_sweep.analyze(llama_dir, device="cpu")["alpha"],
                               rtol=1e-12)


@pytest.mark.parametrize(("model", "message"), [
    (42, "cannot analyse a int"),
    ({"w": "not a tensor"}, "cannot analyse a dict"),
])
def test_what_cannot_be_analysed_is_one_clear_error(model: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        esd_sweep.analyze(model, device="cpu")


def test_an_unknown_preset_is_one_clear_error(llama_dir: Path) -> None:
    with pytest.raises(UsageError, match="preset 'nope' is not one of ww"):
        esd_sweep.analyze(llama_dir, preset="nope")


def test_a_peft_model_in_memory_asks_for_its_base_and_adapter(llama_dir: Path,
                                                              tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(llama_dir),
                           LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(UsageError, match="adapter="):
        esd_sweep.analyze(model, device="cpu")


def test_ww_columns_and_the_eigenvalues(llama_dir: Path) -> None:
    frame = esd_sweep.analyze(llama_dir, device="cpu", preset="ww", eigenvalues=True)
    assert frame.attrs["fit"] == "preset ww (DKS, float64, embeddings)"
    assert list(frame["layer_id"]) == list(range(len(frame)))
    assert "Embedding" in set(frame["layer_type"])
    for row in frame.itertuples():
        lam = row.eigenvalues
        assert lam is not None and row.lambda_max == pytest.approx(float(np.max(lam)))
        assert row.sv_max == pytest.approx(math.sqrt(row.lambda_max))
        expected = ("over-trained" if row.alpha < 2 else
                    "under-trained" if row.alpha > 6 else "")
        assert row.warning == expected, row.longname
    default = esd_sweep.analyze(llama_dir, device="cpu")
    assert default["warning"].isna().all()  # xmin_mid: WeightWatcher's band does not apply
