"""The inference worker (PyTorch). Built in a later issue; imports only `kvpool`."""
