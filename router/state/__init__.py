"""What the router knows of its workers: membership and health, their KV blocks (the
index and its event feed), their load, the cache agreement check, and the other
replicas. Pure state apart from the I/O loops that feed it."""
