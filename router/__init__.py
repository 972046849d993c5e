"""The KV-aware router (FastAPI): OpenAI-compatible endpoints in front of a pool of workers,
each request sent to the worker that holds most of its prompt's KV blocks and is not
overloaded. Imports only the core (``kvpool``); see the README's design section."""
