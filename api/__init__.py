"""The HTTP API: routes, auth, schemas and the one place errors become responses."""
