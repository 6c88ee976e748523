"""The server's start-up options that vLLM users bring: API keys (several; `$VLLM_API_KEY` read like
`$PAGEDLLM_API_KEY`), CORS (off unless `--allowed-origins` is given), TLS (`--ssl-keyfile`,
`--ssl-certfile`, ...), `--root-path` behind a proxy, and the start-up lines that say where the
server listens and how to bind every interface. Owns the flags and their translation into
uvicorn / Starlette settings; api_server.py calls it."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Mapping

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_server_option_args(g: Any) -> None:
    def json_list(value: str) -> list[str]:
        try:
            out = json.loads(value)
        except json.JSONDecodeError:
            out = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(out, str):
            out = [out]
        if not isinstance(out, list) or not all(isinstance(v, str) for v in out):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
        return out

    g.add_argument("--allowed-origins", type=json_list, default=None,
                   help='CORS: origins browsers may call from, a JSON list (\'["https://a.example"]\' or '
                   '\'["*"]\'). Default: no CORS headers at all.')
    g.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS: allowed methods (JSON list).")
    g.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS: allowed headers (JSON list).")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key file (serve https).")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate file (serve https).")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify clients against.")
    g.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="Whether a client certificate is required (Python's ssl.CERT_* value: 0, 1, 2).")
    g.add_argument("--root-path", default=None, help="Path prefix the server is mounted under behind a proxy.")


def api_keys(ns: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> list[str]:
    """--api-key (one or several), else $PAGEDLLM_API_KEY, else $VLLM_API_KEY."""
    given = ns.api_key
    if isinstance(given, str):
        given = [given]
    keys = [k for k in (given or []) if k]
    if not keys:
        keys = [environ[v] for v in ("PAGEDLLM_API_KEY", "VLLM_API_KEY") if environ.get(v)][:1]
    return keys


def add_cors(app: Any, ns: argparse.Namespace) -> None:
    if not getattr(ns, "allowed_origins", None):
        return
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=ns.allowed_origins, allow_methods=ns.allowed_methods,
                       allow_headers=ns.allowed_headers, allow_credentials=ns.allow_credentials)


def uvicorn_options(ns: argparse.Namespace) -> dict[str, Any]:
    if bool(ns.ssl_keyfile) != bool(ns.ssl_certfile):
        raise ValueError("ssl_keyfile and ssl_certfile: give both to serve https")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(ns, name)
        if path and not os.path.isfile(path):
            raise ValueError(f"{name}: {path!r} is not a file")
    out: dict[str, Any] = dict(ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile,
                               ssl_ca_certs=ns.ssl_ca_certs, ssl_cert_reqs=ns.ssl_cert_reqs)
    if ns.root_path:
        out["root_path"] = ns.root_path
    return out


def startup_lines(ns: argparse.Namespace, name: str, model: str, num_keys: int) -> list[str]:
    scheme = "https" if ns.ssl_certfile else "http"
    root = (ns.root_path or "").rstrip("/")
    lines = [f"serving {name} on {scheme}://{ns.host}:{ns.port}{root} (model {model}); "
             f"API key {'required (' + str(num_keys) + ')' if num_keys else 'not required'}; "
             f"CORS {'for ' + ', '.join(ns.allowed_origins) if ns.allowed_origins else 'off'}"]
    if ns.host in _LOOPBACK:
        lines.append(f"listening on {ns.host} only (this machine); --host 0.0.0.0 binds every interface "
                     "(set --api-key before you do)")
    return lines
