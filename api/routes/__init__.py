"""HTTP routes of the native API, one module per resource (the OpenAI ones: `api.openai`)."""
