"""The sharded Kubernetes mode (default): the list cut into shards by resource class and bytes
(plan, sharding), one Indexed Job per class (indexed), where each stands (status), run by the
backend (backend)."""
