"""A TLS front for a server that listens on 127.0.0.1 only: what `qllm.services.serve` starts before each
team server when it is served beyond this host with `--tls-cert/--tls-key`.

    python -m qllm.services.tls_front --listen HOST:PORT --to PORT --cert CERT.pem --key KEY.pem [--probe PATH]

It accepts TLS (1.2 or newer) on HOST:PORT and relays each connection's bytes both ways to
127.0.0.1:PORT, so the server itself never listens beyond this host and every password that
crosses the network is encrypted. It is a byte relay, as stunnel or `nginx stream { ssl }` is:
the servers see plain HTTP from 127.0.0.1. A reverse proxy of your own (nginx, Caddy) in front of
the same loopback ports does the same job (docs/deployments.md).

It fronts only a server that asks for credentials: before it listens, it sends the server an
unauthenticated `GET PATH` (`--probe`, default `/`; waiting up to `--wait` seconds for a server
that is still starting) and goes on only on HTTP 401. Any other answer (a 200 from a server
without a key or password, a 404 from a path that proves nothing) ends it with exit code 2: TLS
in front of an open server would serve it to the network without authentication.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import signal
import ssl
import sys
import time

CHUNK = 1 << 16
ASKS_FOR_CREDENTIALS = 401


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A server-side context with `cert` (its chain) and `key`; TLS 1.2 at least."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        with contextlib.suppress(ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):  # the peer went away
            while data := await reader.read(CHUNK):
                writer.write(data)
                await writer.drain()
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _connection(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, port: int) -> None:
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        client_writer.close()
        return
    with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError, OSError):  # a peer gone without TLS's close_notify
        await asyncio.gather(_relay(client_reader, upstream_writer), _relay(upstream_reader, client_writer))


def _quiet(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """A client that fails the handshake (plain HTTP, an unknown certificate) is its own business."""
    if isinstance(context.get("exception"), (ssl.SSLError, ConnectionError, TimeoutError)):
        return
    loop.default_exception_handler(context)


async def serve(host: str, port: int, target: int, context: ssl.SSLContext) -> None:
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_quiet)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = await asyncio.start_server(lambda r, w: _connection(r, w, target), host, port, ssl=context)
    async with server:
        await stop.wait()


def probe(port: int, path: str, wait: float) -> int | None:
    """The HTTP status 127.0.0.1:`port` answers to `GET path` without credentials; None when
    nothing answers within `wait` seconds (a server still starting is waited for)."""
    deadline = time.monotonic() + wait
    while True:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=max(1.0, min(30.0, wait)))
        try:
            connection.request("GET", path, headers={"Host": f"127.0.0.1:{port}"})
            return connection.getresponse().status
        except (OSError, http.client.HTTPException):  # not listening yet, or closed before answering
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)
        finally:
            connection.close()


def refusal(port: int, path: str, status: int | None, wait: float) -> str | None:
    """Why not to front the server on 127.0.0.1:`port` (`probe`'s `status`), or None to go on."""
    if status == ASKS_FOR_CREDENTIALS:
        return None
    if status is None:
        return f"tls_front: nothing answered on 127.0.0.1:{port} within {wait:g} s (GET {path})"
    return (f"tls_front: 127.0.0.1:{port} answered GET {path} without credentials (HTTP {status}), not 401: fronted, it would "
            "be served to the network without authentication. Give the server a key or password (qllm serve-openai: "
            "--api-key-file, with --tls-cert/--tls-key of its own instead of this front), or --probe a path it protects")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qllm.services.tls_front", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", required=True, metavar="HOST:PORT")
    parser.add_argument("--to", required=True, type=int, metavar="PORT", help="the server's port on 127.0.0.1")
    parser.add_argument("--cert", required=True, help="PEM certificate (chain) the front presents")
    parser.add_argument("--key", required=True, help="PEM private key of --cert")
    parser.add_argument("--probe", default="/", metavar="PATH",
                        help="a path the server answers 401 without credentials (default /); any other answer: no front")  # fmt: skip
    parser.add_argument("--wait", type=float, default=120.0, metavar="SECONDS", help="how long to wait for the server to answer (default 120)")
    args = parser.parse_args(argv)
    if not args.wait > 0:
        parser.error(f"--wait must be a positive number of seconds (got {args.wait:g})")
    host, _, port = args.listen.rpartition(":")
    try:
        context = server_context(args.cert, args.key)
    except (OSError, ssl.SSLError) as exc:
        print(f"tls_front: cannot load --cert {args.cert} / --key {args.key}: {exc}", file=sys.stderr)
        return 2
    refused = refusal(args.to, args.probe, probe(args.to, args.probe, args.wait), args.wait)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    asyncio.run(serve(host.strip("[]"), int(port), args.to, context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
