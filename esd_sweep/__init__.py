"""esd-sweep's Python API: weight spectra of models as pandas DataFrames, in a notebook.

    import esd_sweep
    layers = esd_sweep.analyze(model)        # a torch module, state dict, folder or hub id
    layers = esd_sweep.analyze("org/name", preset="ww")   # WeightWatcher's analysis
    sweep = esd_sweep.load("results/")       # a sweep's store: a folder or s3://…
    sweep.layers(), sweep.models(), sweep.summary(), sweep.failures()
    esd_sweep.plot_esd(sweep.eigenvalues(model_id, layer), alpha=…, xmin=…)

The one public module: these names are the API (docs/api.md). Importing it imports neither
torch nor the hub client: `analyze` does, when called; `load` and everything that reads a
store never do. The analysis is the worker's (esd_worker.analysis) and the store's reading
is the controller's (controller.results), so a notebook and `esd-sweep run` give the same
numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["PRESETS", "Sweep", "analyse", "analyze", "load", "plot_esd"]

if TYPE_CHECKING:
    from esd_sweep.analysis import analyse, analyze
    from esd_sweep.plots import plot_esd
    from esd_sweep.results import Sweep, load
    from esd_worker.core.command.presets import PRESETS

_WHERE = {
    "analyze": "esd_sweep.analysis", "analyse": "esd_sweep.analysis",
    "load": "esd_sweep.results", "Sweep": "esd_sweep.results",
    "plot_esd": "esd_sweep.plots", "PRESETS": "esd_worker.core.command.presets",
}


def __getattr__(name: str) -> Any:
    """The API's names, each imported when first used (torch only with `analyze`)."""
    if name not in _WHERE:
        raise AttributeError(f"module 'esd_sweep' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
