"""inferq: an asynchronous job queue for LLM inference. This package is its command line."""

__version__ = "0.1.0"
