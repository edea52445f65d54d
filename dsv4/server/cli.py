"""``dsv4 serve``: the OpenAI-compatible server.

Engine flags are the shared ones of ``dsv4.cli`` (vLLM's names, the same as for
``dsv4 generate``), so each option has one definition.
"""

from __future__ import annotations

import argparse
import logging

from dsv4.cli import add_engine_flags, engine_options


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server", description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--served-model-name", help="model name in the API (default: --model as given)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds in-flight requests may run on after a shutdown signal before they are aborted",
    )
    add_engine_flags(parser.add_argument_group("engine"))
    parser.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from dsv4.engine.async_engine import AsyncEngine
    from dsv4.engine.engine import LLMEngine
    from dsv4.server.app import DrainingServer, create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(LLMEngine(args.model, **engine_options(args)))
    app = create_app(engine, served_model_name=args.served_model_name or args.model, api_key=args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port)
    DrainingServer(config, engine, args.shutdown_grace).run()
    return 0
