"""The results store: where bytes live (stores, s3), the key layout and write order (layout),
the marker (marker), failure records (records) and the per-layer table (results)."""
