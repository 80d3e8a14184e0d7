"""Options of `nanoforge serve` (cli.add_option_flags), without torch or fastapi: `--help` shows them without
loading either."""
from __future__ import annotations

from dataclasses import dataclass

from nanoforge.core.config import option


@dataclass
class ServeOptions:
    host: str = option("127.0.0.1", help="address to bind; anything but loopback wants --api-key")
    port: int = option(8000, "[1, 65535]", help="TCP port")
    api_key: str | None = option(None, help="require 'Authorization: Bearer KEY' on /v1 (default: $NANOFORGE_API_KEY, "
                                 "else none)")
    request_timeout: float = option(300.0, "[0, inf)", help="seconds a request may take, queueing included; the reply "
                                    "then ends with finish_reason length (0: no limit)")
    max_pending: int = option(64, "[1, inf)", help="requests in the server (generating or waiting) beyond this get "
                              "503 server_busy")
    max_batch: int = option(32, "[1, inf)", help="requests generated together (KV cache slots); more wait for a "
                            "free slot")
    header_timeout: float = option(10.0, "[0, inf)", help="seconds a request's headers may take to arrive, from the "
                                   "connection's start or its last reply; then 408 and closed (0: no limit)")
    body_timeout: float = option(30.0, "[0, inf)", help="seconds a request's body may take to arrive after its "
                                 "headers; then 408 and closed (0: no limit)")
    max_connections: int = option(256, "[1, inf)", help="open connections served; 8 more may ask GET /health, "
                                  "further ones are closed at once (lowered to what ulimit -n allows)")
    log_level: str = option("info", choices=("critical", "error", "warning", "info", "debug"), help="uvicorn's log")
