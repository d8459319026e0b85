"""Owning an output while writing it: the lease (lease) and whether it is still held (tenure)."""
