"""The uvicorn server around the app: limits on connections, draining from the signal on, exit 0.

uvicorn alone cancels the request tasks at ``timeout_graceful_shutdown`` before the app hears of the
shutdown (lifespan runs last), so streams lost their terminator and the exit status was the signal's.
``Server.shutdown`` first lets the app drain (``ServerState.drain``: queued requests 503 at once, running
ones until ``--shutdown-timeout`` and then a 503 error event + ``[DONE]``), then closes the connections;
a SIGINT/SIGTERM is handled here (``handle_exit``), not recorded for uvicorn to re-raise after the
shutdown, so a clean shutdown exits 0.

uvicorn is used through its documented surface: ``Config``, ``Server.serve/run/shutdown``,
``Server.handle_exit`` (the signal handler, overridden) and ``should_exit``/``force_exit``. The one
internal piece, the h11 protocol that ``limits.LimitedH11Protocol`` extends, is why pyproject pins
uvicorn to the versions tested (tests/test_dependencies.py fails on an incompatible one).
"""

from __future__ import annotations

import signal

import uvicorn

from kimik3.serve.limits import Limits, protocol_class, raise_fd_limit


def server_config(app, limits: Limits, **kwargs) -> uvicorn.Config:
    """uvicorn settings for ``app`` under ``limits`` (the h11 protocol with the head deadline and connection cap)."""
    cap = raise_fd_limit(limits.max_connections)
    if cap != limits.max_connections:
        from dataclasses import replace
        limits = replace(limits, max_connections=cap)
    kwargs.setdefault("timeout_graceful_shutdown", 10)     # after the drain: only finished responses are left
    return uvicorn.Config(app, http=protocol_class(limits), lifespan="on", **kwargs)


class Server(uvicorn.Server):
    async def shutdown(self, sockets=None) -> None:
        state = _find_state(self.config.loaded_app)
        if state is not None:
            await state.drain()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """SIGINT/SIGTERM: start the drain (a second SIGINT forces the exit). Unlike uvicorn's own handler it
        does not record the signal to re-raise after the shutdown: drained, the process exits 0."""
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def _find_state(app):
    """The ``ServerState`` of the app under uvicorn's wrappers (None for another app)."""
    for _ in range(16):
        st = getattr(getattr(app, "state", None), "kimik3", None)
        if st is not None:
            return st
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None
