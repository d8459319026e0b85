"""What both Kubernetes modes share: the client adapter (client, the only importer of the
`kubernetes` package), its errors, names and labels, Job objects (jobs), settings, quantities,
YAML output, GPU telemetry and placement, the watch, and why a Job fails or waits (diagnosis)."""
