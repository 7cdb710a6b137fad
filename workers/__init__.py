"""GPU-pinned Celery workers, each holding one vLLM engine."""
