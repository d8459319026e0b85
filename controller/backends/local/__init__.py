"""The local backend: workers as subprocesses on this machine's GPUs (or CPU slots).

backend (LocalBackend: the Backend contract, and the loop's Dispatcher), settings
(LocalSettings, which the run's settings hold), loop (the run loop: reap, retry, stop), tasks
(a task across its attempts), needs (GPUs per model), process (one worker attempt as a
subprocess), slots and served (long-lived `esd-worker --serve` workers, one per slot)."""
