"""A long-lived worker process: where its models come from (inbox), one model after another
(batch), the wiring of inbox, prefetcher and analysis (runner), the device check (selfcheck)."""
