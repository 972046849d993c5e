"""The kopf operator for InferencePool resources. Built in a later issue; imports only `kvpool`."""
