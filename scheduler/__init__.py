"""Which queue a job goes to, and the Celery app both the API and the workers share."""
