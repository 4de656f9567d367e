"""The HTTP server: engine loop, API messages, FastAPI app."""
