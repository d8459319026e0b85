"""The sweep controller: model list, resume plan, dispatch, retries, failure records, summary."""

__version__ = "0.1.0"
