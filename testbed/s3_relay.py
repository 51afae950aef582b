"""An HTTP relay on 127.0.0.1 in front of an S3 server that misbehaves on chosen requests.

:class:`testbed.local_s3.CuttableLink` relays bytes; this one reads each request and response
whole (HTTP/1.1, ``Content-Length`` or chunked bodies, one request at a time on a connection, as
S3 clients send them), so that a :class:`Rule` can pick one request by method and target (its
path and query: ``partNumber=2``, ``manifests/``) and do to it what real stores and networks do:

- ``hold``: take the request and never answer (a stalled gateway, a hung multipart part): the
  connection stays open until the relay closes or ``seconds`` pass;
- ``delay``: answer ``seconds`` late;
- ``drop``: close the connection without answering; ``reset``: the same with a TCP reset;
- ``truncate``: send the response's head and half its body, then close;
- ``status``: send the server's response with another status (``rewrite=(412, 409)``: the
  ``409 ConditionalRequestConflict`` some providers answer to a lost conditional write).

Every rule is bounded: ``times`` requests at most (None: all that match while it is installed),
and a hold by ``seconds`` (None: until :meth:`Relay.close`). It listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

_REASONS = {409: "Conflict", 412: "Precondition Failed", 500: "Internal Server Error", 503: "Service Unavailable"}
_CODES = {409: "ConditionalRequestConflict", 412: "PreconditionFailed", 503: "SlowDown", 500: "InternalError"}


@dataclass
class Rule:
    action: str  # hold, delay, drop, reset, truncate, status
    method: str | None = None  # PUT, GET, ...; None: any
    target: str = ""  # a regular expression searched in the request target (path and query)
    times: int | None = 1
    seconds: float | None = None  # delay's length; hold's bound (None: until the relay closes)
    rewrite: tuple[int, int] | None = None  # status: (from, to)
    hits: list[str] = field(default_factory=list)  # the targets of the requests it took
    rewritten: int = 0  # responses whose status it changed (``status``)
    first_at: float | None = None  # time.monotonic() when it took its first request

    def matches(self, method: str, target: str) -> bool:
        if self.times is not None and len(self.hits) >= self.times:
            return False
        return (self.method is None or self.method == method) and re.search(self.target, target) is not None


class _Closed(Exception):
    pass


def _read_until(sock: socket.socket, buf: bytearray, mark: bytes) -> bytes:
    """The bytes up to and with ``mark``, read on from what ``buf`` already holds."""
    while mark not in buf:
        data = sock.recv(1 << 16)
        if not data:
            raise _Closed
        buf += data
    end = buf.index(mark) + len(mark)
    out = bytes(buf[:end])
    del buf[:end]
    return out


def _read_head(sock: socket.socket, buf: bytearray) -> bytes:
    return _read_until(sock, buf, b"\r\n\r\n")


def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        data = sock.recv(max(1 << 16, n - len(buf)))
        if not data:
            raise _Closed
        buf += data
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _read_line(sock: socket.socket, buf: bytearray) -> bytes:
    return _read_until(sock, buf, b"\r\n")


def _headers(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            out[name.decode().strip().lower()] = value.decode().strip()
    return out


def _read_body(sock: socket.socket, buf: bytearray, headers: dict[str, str], *, until_close: bool) -> bytes:
    """The body, raw as sent (a chunked body keeps its chunk framing)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            line = _read_line(sock, buf)
            out += line
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = _read_line(sock, buf)
                    out += trailer
                    if trailer == b"\r\n":
                        return bytes(out)
            out += _read_exact(sock, buf, size + 2)
    if "content-length" in headers:
        return _read_exact(sock, buf, int(headers["content-length"]))
    if until_close:
        out = bytearray(buf)
        buf.clear()
        while data := sock.recv(1 << 16):
            out += data
        return bytes(out)
    return b""


class Relay:
    """Listens on 127.0.0.1 and relays to ``127.0.0.1:target_port``, applying :attr:`rules`."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str]] = []  # (method, target) of every request seen
        self.answered: list[tuple[str, str, int]] = []  # (method, target, bytes of the body) of every answer sent
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def retarget(self, port: int) -> None:
        """Relay new connections to ``port`` from now on (a load balancer's new backend)."""
        self._target = port

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def held(self, rule: Rule, count: int = 1, within: float = 120.0) -> bool:
        """Wait until ``rule`` has acted on ``count`` requests (True), or ``within`` seconds passed."""
        deadline = time.monotonic() + within
        while len(rule.hits) < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.01)
                continue
            with self._lock:
                self._sockets.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True, name="relay-conn").start()

    def _rule_for(self, method: str, target: str) -> Rule | None:
        with self._lock:
            self.requests.append((method, target))
            for rule in self.rules:
                if rule.matches(method, target):
                    rule.hits.append(target)
                    if rule.first_at is None:
                        rule.first_at = time.monotonic()
                    return rule
        return None

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while not self._closed.is_set():
                head = _read_head(client, cbuf)
                request_line = head.split(b"\r\n", 1)[0].decode(errors="replace")
                method, target = [*request_line.split(" "), "", ""][:2]
                headers = _headers(head)
                if headers.get("expect", "").lower() == "100-continue":
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = re.sub(rb"(?im)^expect:[^\r\n]*\r\n", b"", head)
                body = _read_body(client, cbuf, headers, until_close=False)
                rule = self._rule_for(method, target)
                if rule is not None and rule.action == "hold":
                    self._closed.wait(rule.seconds)
                    return
                if rule is not None and rule.action in ("drop", "reset"):
                    if rule.action == "reset":
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                if rule is not None and rule.action == "delay":
                    if self._closed.wait(rule.seconds or 0):
                        return
                if upstream is None:
                    upstream = socket.create_connection(("127.0.0.1", self._target))
                    with self._lock:
                        self._sockets.add(upstream)
                upstream.sendall(head + body)
                rhead = _read_head(upstream, ubuf)
                while rhead.split(b" ", 2)[1] == b"100":  # an interim answer: the real one follows
                    rhead = _read_head(upstream, ubuf)
                rheaders = _headers(rhead)
                status = int(rhead.split(b" ", 2)[1])
                bodiless = method == "HEAD" or status in (204, 304)
                closes = rheaders.get("connection", "").lower() == "close"
                rbody = b"" if bodiless else _read_body(upstream, ubuf, rheaders, until_close=True)
                if rule is not None and rule.action == "status" and rule.rewrite and status == rule.rewrite[0]:
                    rhead, rbody = self._rewritten(rhead, rbody, rule.rewrite[1], bodiless)
                    rule.rewritten += 1
                if rule is not None and rule.action == "truncate":
                    client.sendall(rhead + rbody[: len(rbody) // 2])
                    return
                client.sendall(rhead + rbody)
                with self._lock:
                    self.answered.append((method, target, len(rbody)))
                framed = "content-length" in rheaders or "transfer-encoding" in rheaders or bodiless
                if closes or not framed:
                    return
        except (OSError, _Closed, ValueError, IndexError):
            return
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with self._lock:
                        self._sockets.discard(sock)
                    with contextlib.suppress(OSError):
                        sock.close()

    @staticmethod
    def _rewritten(head: bytes, body: bytes, status: int, bodiless: bool) -> tuple[bytes, bytes]:
        lines = head.split(b"\r\n")
        lines[0] = f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}".encode()
        if not bodiless:
            body = re.sub(rb"<Code>[^<]*</Code>", f"<Code>{_CODES.get(status, 'Error')}</Code>".encode(), body)
            if b"chunked" in head.lower():  # one chunk again: its length changed
                inner = re.sub(rb"^[0-9a-fA-F]+\r\n|\r\n0\r\n\r\n$|\r\n[0-9a-fA-F]+\r\n", b"", body)
                body = f"{len(inner):x}\r\n".encode() + inner + b"\r\n0\r\n\r\n"
            else:
                lines = [
                    f"Content-Length: {len(body)}".encode() if line.lower().startswith(b"content-length:") else line
                    for line in lines
                ]
        return b"\r\n".join(lines), body

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in list(self._sockets):
                with contextlib.suppress(OSError):
                    sock.close()
            self._sockets.clear()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
