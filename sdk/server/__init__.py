"""`dayzero serve`: an OpenAI-compatible HTTP server on the engine.

`async_engine` runs the engine on its own thread; `detok` turns token streams into text with
stop strings; `protocol` holds the request schemas; `app` the FastAPI routes; `metrics` the
Prometheus collectors.
"""
