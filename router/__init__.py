"""The KV-aware router (FastAPI). Built in a later issue; imports only `kvpool`."""
