"""The results side of esd-sweep: reading a results store and what is made from it.

reader: open a store, its markers and layer tables as ModelResults, adapters' bases.
summary: summary.csv (rows, encoding, writing) and its first rows as text.
report: `esd-sweep report` from the results tables (tables): overview and aggregates
    (streamed numbers of all models), failures, plots (PNGs), pages (per-model pages) and html
    (index.html); extras imports their matplotlib/pyarrow.
refit: `esd-sweep refit`, fits recomputed from stored eigenvalues.
compare: `esd-sweep compare`, per-layer differences between two sets of results.

Key names are esd_worker.core.store.layout's. Nothing here runs a sweep or talks to a cluster.
"""
