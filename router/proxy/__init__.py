"""The data path's legs: receive a request, try workers (attempts and retries), relay
the answer (SSE included), and the HTTP client to the workers."""
