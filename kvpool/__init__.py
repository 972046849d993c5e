"""kvpool: a KV-cache-aware pool of LLM inference workers on Kubernetes.

This package is the shared core: the contracts that the router, the workers and the
operator must agree on byte for byte. It imports no component.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvpool")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"
