"""What operators read: health, models, metrics, debug endpoints and the OpenAPI text."""
