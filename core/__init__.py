"""Shared pieces of inferq: settings, storage, job states, Redis key names, tiers, errors."""
