"""What both Kubernetes modes share: the client adapter (client, the only importer of the
`kubernetes` package), its errors, names and labels, Job objects (jobs), settings, quantities,
what a pod asks for (resources), YAML output, GPU telemetry and placement, the watch, why a
Job fails or waits (diagnosis; kueue asks for what holds it), and what a backend is built
from (wiring)."""
