"""A model's weights before any download: their bytes (sizing) and their shape and GPU count
(weightmeta), from the list's columns, a local directory or the hub (hubclient, its HTTP
client)."""
