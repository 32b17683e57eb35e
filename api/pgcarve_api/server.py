"""`pgcarve serve`: run the API with uvicorn and record where it listens (server.json)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import uvicorn
from pgcarve.config import Paths

from pgcarve_api.main import create_app
from pgcarve_api.security import load_or_create_token
from pgcarve_api.settings import Settings


def serve(host: str, port: int, hosts_file: str | None, paths: Paths) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(state_dir=paths.state_dir, hosts_file=Path(hosts_file) if hosts_file else None,
                        bind=host, port=port)
    token, created = load_or_create_token(settings.token, paths.token_file)
    if created and sys.stderr.isatty():
        # Shown once, on first start, to a person at a terminal; never written into a log file.
        print(f"pgcarve: new API token (also in {paths.token_file}): {token}", file=sys.stderr, flush=True)
    elif created:
        print(f"pgcarve: new API token written to {paths.token_file} (mode 0600)", file=sys.stderr, flush=True)
    app = create_app(settings)
    url_host = f"[{host}]" if ":" in host else host
    paths.server_file.write_text(json.dumps({"pid": os.getpid(), "url": f"http://{url_host}:{port}"}))
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
    finally:
        paths.server_file.unlink(missing_ok=True)
    return 0
