"""The inference worker (PyTorch): a paged KV cache with prefix caching, continuous
batching, prefill/decode hand-off, KV events, and an OpenAI-compatible server. Imports only
the core (``kvpool``); see the README's design section."""
