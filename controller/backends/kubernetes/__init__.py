"""The Kubernetes backend (`--backend kubernetes`): one worker Job per model.

Modules, from the contract inward: backend (KubernetesBackend, the Backend protocol and the
run loop), submit (adopt and create Jobs), events (what Job changes mean), watch (the watch
thread), state (each model's state), placement (GPU telemetry placement), diagnosis (why a
Job failed or waits), jobs and names (the Job objects and what they are called), settings
(ClusterSettings), telemetry (dcgm metrics), errors (the exception family), client (the
only module that imports the optional `kubernetes` package; nothing here imports it, so
`import controller.backends.kubernetes.settings` works without it).
"""
