"""A real S3 server on 127.0.0.1 for tests and benchmarks: moto's ``ThreadedMotoServer``.

It speaks the S3 wire protocol (conditional puts included), so the S3 backend is tested
exactly as it talks to AWS, and nothing leaves this machine. Clients find it through the
standard AWS environment variables, which :meth:`LocalS3.environ` lists.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import secrets
import shutil
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3
from moto.server import ThreadedMotoServer

BUCKET = "tailor-test"


def installed_binary(name: str) -> str | None:
    """A server's binary: beside this Python (where pip puts a ``*-bin`` package's), else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


_PUTS = threading.Lock()


def _atomic_conditional_puts() -> None:
    """moto checks ``If-None-Match``/``If-Match`` and then writes the object, two steps of one
    request on the request's own thread, so two create-only PUTs of one key at once could both pass
    the check (two racing ``commit --force`` of one step both exited 0 once, under load). S3 decides
    a conditional write atomically; this server does too once its object PUTs run one at a time."""
    from moto.s3.responses import S3Response

    inner = S3Response._key_response_put
    if getattr(inner, "tailor_atomic", False):
        return

    def put(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with _PUTS:
            return inner(self, *args, **kwargs)

    put.tailor_atomic = True  # type: ignore[attr-defined]
    S3Response._key_response_put = put  # type: ignore[method-assign]


class LocalS3:
    def __init__(self) -> None:
        self._server: ThreadedMotoServer | None = None
        self.port = 0  # chosen by the first start, kept by restart
        self.endpoint = ""

    def start(self) -> LocalS3:
        _atomic_conditional_puts()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        host, self.port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{self.port}"
        client = boto3.client("s3", **self._client_args())
        if BUCKET not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket=BUCKET)
        return self

    def stop(self) -> None:
        """Stop answering; the objects stay (moto keeps them in this process) for a restart."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    def restart(self) -> None:
        self.start()

    def _client_args(self) -> dict[str, str]:
        env = self.environ()
        return {
            "endpoint_url": self.endpoint,
            "region_name": env["AWS_REGION"],
            "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        }

    def environ(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "tailor-test",
            "AWS_SECRET_ACCESS_KEY": "tailor-test",
        }

    def new_location(self) -> str:
        """A fresh, empty prefix for one store."""
        return f"s3://{BUCKET}/{secrets.token_hex(6)}"

    def keys(self, location: str) -> list[str]:
        prefix = location.split(f"s3://{BUCKET}/", 1)[1].rstrip("/") + "/"
        client = boto3.client("s3", **self._client_args())
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [item["Key"][len(prefix) :] for page in pages for item in page.get("Contents", [])]

    def objects(self, location: str) -> dict[str, bytes]:
        """Every object under a store location, read with boto3 (not through tailorstore)."""
        prefix = location.split(f"s3://{BUCKET}/", 1)[1].rstrip("/") + "/"
        client = boto3.client("s3", **self._client_args())
        out: dict[str, bytes] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            for item in page.get("Contents", []):
                body = client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
                out[item["Key"][len(prefix) :]] = body
        return out


@contextmanager
def local_s3() -> Iterator[LocalS3]:
    """Start a server, point the AWS variables of this process (and its children) at it."""
    server = LocalS3().start()
    saved = {k: os.environ.get(k) for k in server.environ()}
    os.environ.update(server.environ())
    try:
        yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


_REQUEST = re.compile(rb"(HEAD|GET|PUT|POST|DELETE) /([^ ?]*)[^ ]* HTTP/1\.1\r\n")


class _Pair:
    """A client connection and its upstream one, closed once both directions are finished."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self._left = 2
        self._lock = threading.Lock()

    def done(self) -> bool:
        """One direction finished; True for the second."""
        with self._lock:
            self._left -= 1
            return self._left == 0


class CuttableLink:
    """A TCP relay in front of the server that counts the bytes each way and the requests by
    method and store area (``"GET packs"``), can hold each request back by ``delay`` seconds
    (the first-byte latency of a real object store, which a local server does not have), and
    can be cut: every open connection is reset and new ones are refused, as when a server or
    the network between goes away mid-request."""

    def __init__(self, target_port: int, delay: float = 0.0) -> None:
        self.sent = 0  # bytes from clients to the server
        self.received = 0  # bytes from the server to clients
        self.requests: collections.Counter[str] = collections.Counter()
        self.delay = delay
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                if self._cut:
                    return
                time.sleep(0.01)  # a transient failure (out of descriptors): never stop relaying for good
                continue
            upstream = socket.create_connection(("127.0.0.1", self._target))
            with self._lock:
                if self._cut:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            pair = _Pair(client, upstream)
            threading.Thread(target=self._pipe, args=(client, upstream, True, pair), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False, pair), daemon=True).start()

    def _count_requests(self, data: bytes, tail: bytes) -> int:
        """Count the request lines that end in ``data`` (``tail`` is the end of the previous read)."""
        seen = 0
        for match in _REQUEST.finditer(tail + data):
            if match.end() > len(tail):
                # /bucket/prefix/area/...: the area of a store's key (blobs, packs, manifests, ...)
                parts = match.group(2).decode(errors="replace").split("/")
                with self._lock:
                    self.requests[f"{match.group(1).decode()} {parts[2] if len(parts) > 2 else ''}"] += 1
                seen += 1
        return seen

    def _pipe(self, src: socket.socket, dst: socket.socket, upward: bool, pair: _Pair) -> None:
        tail = b""
        try:
            while data := src.recv(1 << 18):
                if upward:
                    if self._count_requests(data, tail) and self.delay:
                        time.sleep(self.delay)
                    tail = data[-256:]
                dst.sendall(data)
                with self._lock:
                    if upward:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            if pair.done():  # both ways finished: close the two sockets, which would otherwise pile up
                with self._lock:  # over a long benchmark (a client drops a connection per unread body)
                    for sock in (pair.client, pair.upstream):
                        if sock in self._sockets:
                            self._sockets.remove(sock)
                        sock.close()

    def reset_counts(self) -> None:
        with self._lock:
            self.sent = self.received = 0
            self.requests.clear()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            self._listener.close()
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
                    sock.close()
