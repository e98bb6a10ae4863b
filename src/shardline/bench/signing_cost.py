"""What signing costs a node-to-node request: ``python -m shardline.bench.signing_cost``.

Sends the same requests through one ASGI app (FastAPI, in-process over httpx's ASGI
transport, so no socket noise) with and without :class:`~shardline.api.http_guard.SignatureMiddleware`
and a signing client, and prints the time per request of each and the difference: the
client's HMAC and body hash, the server's check, nonce cache and answer signature.
Bodies: a poll (no body), a table (2 KiB), a prompt's token ids (40 KiB), 1 MiB, and the
link probe's 1 MiB upload (whose body is not signed).
"""

from __future__ import annotations

import asyncio
import time

import httpx
from fastapi import FastAPI, Request

from shardline.api.http_guard import SignatureMiddleware
from shardline.node.signing import SignedAuth, signing_key

HOST = "127.0.0.1:52415"


def _app(signed: bool) -> FastAPI:
    app = FastAPI()

    @app.post("/internal/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    @app.post("/internal/echo-bytes")  # the link probe's upload: its body is not signed
    async def echo_bytes(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    if signed:
        app.add_middleware(SignatureMiddleware, key=KEY, names=frozenset({"127.0.0.1"}))
    return app


KEY = signing_key("a benchmark cluster key")


async def _per_request_s(signed: bool, path: str, body: bytes, n: int) -> float:
    transport = httpx.ASGITransport(app=_app(signed), client=("127.0.0.1", 40000))
    auth = SignedAuth(KEY) if signed else None
    async with httpx.AsyncClient(transport=transport, base_url=f"http://{HOST}", auth=auth) as client:
        for _ in range(10):  # warm up
            await client.post(path, content=body)
        started = time.perf_counter()
        for _ in range(n):
            response = await client.post(path, content=body)
            assert response.status_code == 200, response.text
        return (time.perf_counter() - started) / n


def main() -> None:
    print(f"{'body':>12} {'unsigned ms':>12} {'signed ms':>10} {'added ms':>9} {'ratio':>6}")
    for label, path, size, n in (
        ("none", "/internal/echo", 0, 2000),
        ("2 KiB", "/internal/echo", 2048, 2000),
        ("40 KiB", "/internal/echo", 40960, 1000),
        ("1 MiB", "/internal/echo", 2**20, 100),
        ("1 MiB probe", "/internal/echo-bytes", 2**20, 100),
    ):
        body = b"x" * size
        plain = min(asyncio.run(_per_request_s(False, path, body, n)) for _ in range(3))
        signed = min(asyncio.run(_per_request_s(True, path, body, n)) for _ in range(3))
        print(
            f"{label:>12} {plain * 1e3:12.3f} {signed * 1e3:10.3f} {(signed - plain) * 1e3:9.3f} {signed / plain:6.2f}"
        )


if __name__ == "__main__":
    main()
