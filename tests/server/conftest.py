"""Live-server fixtures: the real engine on a tiny random checkpoint, served on
127.0.0.1 at a free port by uvicorn in a background thread."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import uvicorn

from dsv4.engine.async_engine import AsyncEngine
from dsv4.engine.engine import LLMEngine
from dsv4.model.make_tiny import write_tiny_checkpoint
from dsv4.server.app import DrainingServer, create_app

MODEL_NAME = "dsv4-tiny"
MAX_MODEL_LEN = 1024
API_KEY = "sekrit"


class LiveServer:
    """``app`` on 127.0.0.1 at a free port, in a background thread. With ``engine`` it is
    served by ``DrainingServer`` (stopping it drains and shuts down the engine); without,
    by plain uvicorn with the lifespan off, leaving a shared engine running."""

    def __init__(self, app, engine: AsyncEngine | None = None, grace_s: float = 0.0) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on" if engine else "off")
        self._server = DrainingServer(config, engine, grace_s) if engine else uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


@pytest.fixture(scope="session")
def single_thread():
    """A tiny model gains nothing from intra-op threads, and on a busy CI machine
    OpenMP spin-waiting makes every op take milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "v41", "v41", seed=0)


@pytest.fixture(scope="session")
def make_engine(checkpoint, single_thread):
    """Builds an AsyncEngine around a fresh LLMEngine; shut down at the end of the session."""
    built = []

    def make() -> AsyncEngine:
        engine = AsyncEngine(
            LLMEngine(
                checkpoint, progress=False, max_model_len=MAX_MODEL_LEN, block_size=16,
                kv_cache_memory=16 << 20, max_num_seqs=32,
            )
        )
        built.append(engine)
        return engine

    yield make
    for engine in built:
        engine.shutdown()


@pytest.fixture(scope="session")
def engine(make_engine) -> AsyncEngine:
    return make_engine()


@pytest.fixture(scope="session")
def server(engine):
    live = LiveServer(create_app(engine, served_model_name=MODEL_NAME), engine)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def keyed_server(engine):
    live = LiveServer(create_app(engine, served_model_name=MODEL_NAME, api_key=API_KEY))
    yield live
    live.stop()


@pytest.fixture(autouse=True)
def no_unhandled_server_errors(caplog):
    """A path that ends in the app's catch-all handler is a bug even when the client
    (say, one that already left) never sees the 500."""
    yield
    records = caplog.get_records("setup") + caplog.get_records("call")
    errors = [r.getMessage() for r in records if r.name.startswith("dsv4.server") and r.levelno >= logging.ERROR]
    assert not errors


def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> dict:
    """The engine's stats once it has no request and no used block (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = stats["running"] == 0 and stats["waiting"] == 0 and stats["blocks_used"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)
