"""The server itself: the ASGI app (routes, middleware, error handlers, the model loading behind
/health's 503), the socket it listens on, and `serve`, which runs uvicorn until Ctrl-C and stops
the answer in progress when it arrives. `serve` is also this home's resident engine for `localspec
run` and `chat` when no other is (`resident.claim`), and leaves the engine file when it stops."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from localspec.apps.resident import remove_record
from localspec.apps.serve.api import Api
from localspec.apps.serve.config import ServeConfig, middleware
from localspec.apps.serve.requests import ERROR_HANDLERS
from localspec.apps.serve.resident import ResidentRoutes, claim
from localspec.apps.serve.turns import Served, Service
from localspec.base.config import SpecConfig
from localspec.base.errors import LocalspecError


def create_app(load: Callable[[], Served], config: ServeConfig = ServeConfig(), log: Callable[[str], None] | None = None,
               engine_key: str | None = None) -> Starlette:
    """The ASGI app; `load` runs in the background at startup (until it returns, /health says 503).
    `engine_key`: the resident engine's, which its own routes require (None: not the resident engine)."""
    service = Service(load, config, log or (lambda line: None))
    api = Api(service)
    resident = ResidentRoutes(service, engine_key)
    routes = [
        Route("/localspec/v1/generate", resident.generate, methods=["POST"]),
        Route("/localspec/v1/engine", resident.engine, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, middleware=middleware(config), lifespan=service.lifespan,
                    exception_handlers=ERROR_HANDLERS)
    app.state.service = service
    return app


def session_loader(model: str, proposer: str, dtype: str, spec: SpecConfig) -> Callable[[], Served]:
    """What `localspec serve` loads (a registry name: an unknown one fails before the port opens)."""

    def load() -> Served:
        # torch loads here, in the engine thread, once the port is open: /health answers meanwhile
        from localspec.store.session import open_session

        session = open_session(model, proposer, dtype, spec)
        return Served(model, session.engine, session.summary, session.details(), session.record)

    return load


def listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        # create_server's own text repeats the address; a failed name lookup has its own errno space
        reason = (exc.strerror or str(exc)) if isinstance(exc, socket.gaierror) or not exc.errno else os.strerror(exc.errno)
        raise LocalspecError(f"cannot listen on {host}:{port}: {reason}") from None


class GracefulServer(uvicorn.Server):
    """uvicorn, stopping the answer in progress as soon as Ctrl-C arrives, instead of letting its
    stream run on until the grace period cancels it with a traceback."""

    def __init__(self, config: uvicorn.Config, service: Service, on_stop: Callable[[], None] = lambda: None) -> None:
        super().__init__(config)
        self.service, self.on_stop = service, on_stop

    def handle_exit(self, sig, frame) -> None:
        self.service.shutdown()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        # here rather than after `run`: uvicorn ends a SIGTERM'd process by re-raising the signal
        try:
            await super().shutdown(sockets)
        finally:
            self.on_stop()


def serve(config: ServeConfig, load: Callable[[], Served], model: str, dtype: str, spec: SpecConfig) -> int:
    """Listen, load `model` behind /health's 503, serve until Ctrl-C (or, with `exit_when_idle`,
    until the keep-alive unloads it). `model`, `dtype` and `spec`: what `load` loads, told to the
    engine file so that a command asking for the same is answered here."""

    def say(line: str) -> None:
        print(f"localspec: {line}", file=sys.stderr, flush=True)

    sock = listen(config.host, config.port)
    host = f"[{config.host}]" if ":" in config.host else config.host
    failed: list[BaseException] = []

    def load_then_announce() -> Served:
        try:
            served = load()
        except BaseException as exc:
            failed.append(exc)
            server.should_exit = True
            raise
        say(f"ready: {served.name}, {served.about}")
        return served

    url = f"http://{_reachable(host)}:{sock.getsockname()[1]}"
    record = claim(url, model, dtype, spec, config.keep_alive, say)
    try:
        app = create_app(load_then_announce, config, log=say, engine_key=record.key if record else None)
        server = GracefulServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5), app.state.service,
                                on_stop=lambda: record and remove_record(record.pid))
        if config.exit_when_idle:
            app.state.service.on_unload = lambda: setattr(server, "should_exit", True)
        say(f"serving the OpenAI API at http://{host}:{sock.getsockname()[1]}/v1 (loading the model; /health says 503 until ready)")
        server.run(sockets=[sock])
    finally:
        if record is not None:
            remove_record(record.pid)
    if failed:
        raise failed[0]
    say("stopped")
    return 0


def _reachable(host: str) -> str:
    """The address a client on this machine dials for a server listening on `host`."""
    return {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}.get(host, host)
