"""The scheduler process: queue deadlines, the lease reaper, the held-job dispatcher, retention."""
