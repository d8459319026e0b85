"""A run's Prometheus metrics: what `esd-sweep run --metrics-port N` serves at /metrics.

domains.py classifies a failure (its error class → fault domain), runmetrics.py holds the
run's private registry and feeds it (a Progress observer and the recorder's outcomes),
server.py serves that registry while the run runs. docs/operations.md ("Metrics") lists
every metric; docs/grafana/esd-sweep.json is a dashboard over them.
"""
