"""Getting a model's files: the hub over HTTP (hub), a reference to a local directory (resolve),
read-ahead within a disk budget (prefetch) in a cache folder the workers own (cachedir)."""
