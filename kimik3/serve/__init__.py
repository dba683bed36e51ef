"""OpenAI-compatible HTTP server over the engine: ``kimik3 serve`` (FastAPI + uvicorn).

``add_serve_arguments(parser)`` adds the flags, ``serve_main(args)`` runs the server; ``create_app(engine,
ServeOptions(...))`` builds the app around an existing engine (tests, embedding).
"""

from kimik3.serve.app import ServeOptions, create_app
from kimik3.serve.server import (
           add_serve_arguments,
           build_app,
           run_server,
           serve_main,
)

__all__ = ["ServeOptions", "add_serve_arguments", "build_app", "create_app", "run_server", "serve_main"]
