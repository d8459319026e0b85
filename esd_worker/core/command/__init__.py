"""The worker's command line, torch-free so the controller can build and read it: the flags
(workerparser: the `esd-worker` parser; flags: what both commands share, every number with its
range), the frozen settings they make (settings), and one invocation as a value with its argv
(invocation)."""
