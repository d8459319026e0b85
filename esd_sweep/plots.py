"""`esd_sweep.plot_esd`: one layer's ESD with its power-law fit, inline in a notebook.

Owns the notebook's plot of a layer: a row of a layer table (esd_sweep.analyze with
eigenvalues=True, or Sweep.layers with Sweep.eigenvalues) drawn as the report draws it
(controller.results.plots: log-log density, the fitted power law above xmin), titled with
the layer and how it was fitted. pyplot makes the figure, so Jupyter shows it inline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from controller.results.plots import draw_esd
from esd_worker.core.command.presets import band_applies

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def plot_esd(layer: Mapping[str, Any] | Any, eigenvalues: Any = None, *,
             ax: Axes | None = None, fit: str | None = None) -> Figure:
    """Draw a layer's ESD and its fit; returns the Figure.

    layer: a row of a layer table (a pandas Series or a mapping: alpha, xmin, D, status,
    layer, fix_fingers; its `eigenvalues` unless given). eigenvalues: the layer's
    eigenvalues of WᵀW. ax: draw there (default: a new figure). fit: the label of how it
    was fitted (default: the row's fix_fingers; a DataFrame's attrs["fit"] says more).
    """
    row = dict(layer.items()) if hasattr(layer, "items") else dict(layer)
    values = row.get("eigenvalues") if eigenvalues is None else eigenvalues
    if values is None:
        raise ValueError("no eigenvalues: pass them, or a row of analyze(..., eigenvalues=True)")
    lam = np.sort(np.asarray(values, dtype=np.float64))
    lam = lam[lam > 0]
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(5.5, 4), layout="constrained")
    figure = ax.get_figure(root=True)
    assert figure is not None  # an Axes drawn on has a figure
    draw_esd(ax, lam, {k: "" if v is None else str(v) for k, v in row.items()
                        if k != "eigenvalues"})
    how = fit or f"fit {row.get('fix_fingers') or '?'}"
    note = "" if band_applies(row.get("fix_fingers")) else " (not WeightWatcher's fit)"
    ax.set_title(f"{row.get('longname') or row.get('layer', '')}\n{how}{note}", fontsize=9)
    return figure
