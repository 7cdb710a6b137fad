"""The OpenAI-compatible surface: its protocol, serving logic, batches and chat templates."""
