"""The queue contract every process shares: the Celery app, its task, routing and dispatch."""
