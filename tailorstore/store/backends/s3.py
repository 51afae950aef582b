"""The S3 backend, through obstore (Rust's object_store): any S3-compatible server.

A store location ``s3://bucket/prefix`` puts every key under ``prefix/``. The endpoint,
region and credentials come from the standard AWS environment variables
(``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``),
as with the AWS CLI. A PUT is atomic and durable when it returns, so a batch is only a
list of PUTs; ``create_only`` sends ``If-None-Match: *``. Large objects go up as
multipart uploads, which S3 makes visible only when complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from datetime import timedelta
from typing import BinaryIO, TypeVar

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, PreconditionError
from obstore.store import from_url

from tailorstore.core.env_seconds import seconds_from_env
from tailorstore.core.environment import RETRY_ENV, TIMEOUT_ENV
from tailorstore.core.errors import BackendError, ObjectExistsError, StoreError, first_line
from tailorstore.core.failpoints import request
from tailorstore.core.save_bound import Bound, current
from tailorstore.store.backends.base import READ_CHUNK, BytesLike, Chunks, as_chunks, check_key

T = TypeVar("T")
_PART = 8 << 20  # bytes per multipart chunk
_WINDOW = 64 << 20  # most bytes one streamed GET carries: each GET is a round trip, and must end within the timeout
_DELETE_MOST = 1000  # keys in one DeleteObjects request (S3's limit)
_SINGLE_PUT = 64 << 20  # objects up to this size go up in one PUT, held in memory once


def _retry_config() -> dict:
    """How long failing requests are retried before the command fails (``TAILOR_S3_RETRY_SECONDS``,
    default 180 as in obstore); with ``TAILOR_S3_TIMEOUT_SECONDS`` (one request, default 30) a job
    that must fail fast on a dead endpoint can say so."""
    seconds = seconds_from_env(RETRY_ENV, 180, most=3600)
    return {"retry_timeout": timedelta(seconds=seconds), "max_retries": 10 if seconds else 0}


class S3Backend:
    def __init__(self, location: str) -> None:
        if not location.startswith("s3://") or len(location) <= 5:
            raise StoreError(f"{location!r}: an S3 store is named s3://bucket/prefix")
        self.location = location.rstrip("/")
        bucket, _, prefix = self.location[len("s3://") :].partition("/")
        if not bucket or (prefix and any(part in ("", ".", "..") for part in prefix.split("/"))):
            # S3 keeps such keys literally: s3://b/p1/../p2 would be a third store, not p2
            raise StoreError(
                f"{location!r}: an S3 store is named s3://bucket/prefix, with no empty, '.' or '..' parts in the prefix"
            )
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        self.endpoint = endpoint  # which server: the same bucket and prefix on another is another store
        options: dict = {"allow_http": True} if endpoint.startswith("http://") else {}
        one_request = seconds_from_env(TIMEOUT_ENV, 30, most=3600, zero=False)  # 0 would fail every request
        options["timeout"] = f"{one_request:g}s"
        try:
            self._store = from_url(self.location, client_options=options, retry_config=_retry_config())
        except (BaseError, ValueError) as exc:
            raise StoreError(
                f"{location}: cannot open the bucket ({first_line(exc)}); check AWS_ENDPOINT_URL, AWS_REGION "
                "and the credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY."
            ) from None

    def _call(
        self,
        what: str,
        key: str,
        fn: Callable[[], T],
        kind: str,
        fence: Callable[[], None] | None = None,
        bounded: Callable[[list[float]], Awaitable[T]] | None = None,
    ) -> T:
        """Every request goes through here: one failpoint a request (``kind``, core/failpoints.py),
        then the caller's ``fence`` (so a stall anywhere before the request is one the fence sees),
        and one way its failures are named. While a save runs (core/save_bound.py) the request is
        ``bounded``'s coroutine instead, abandoned once it made no progress for the save's bound
        (it moves the list's one time stamp forward as it progresses)."""
        if kind:  # the conditional-write probe's requests pass no failpoint (backends/conditional.py)
            request(kind)
        bound = current() if bounded is not None else None
        if bound is not None and bound.stalled:
            raise bound.error("", first=False)
        if fence is not None:
            fence()
        try:
            if bound is None or _loop_running():
                return fn()
            return self._within(bound, f"{what} {key} on {self.endpoint or 'AWS'}", bounded)  # type: ignore[arg-type]
        except FileNotFoundError as exc:
            if "NoSuchBucket" in str(exc):
                raise self._no_bucket() from None
            raise
        except AlreadyExistsError:
            raise ObjectExistsError(f"{self.location}: {key} already exists") from None
        except (BaseError, OSError) as exc:
            text = str(exc)
            if "NoSuchBucket" in text or (what == "listing" and "404 Not Found" in text):
                raise self._no_bucket() from None
            if any(word in text for word in ("403 Forbidden", "AccessDenied", "InvalidAccessKeyId", "SignatureDoes")):
                raise BackendError(
                    f"{self.location}: the server refused {what} {key} (access denied: {first_line(exc)[:160]}). "
                    "Check the credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and what they may do."
                ) from None
            raise BackendError(
                f"{self.location}: {what} {key} failed ({first_line(exc)}). Check that the server is reachable; "
                "nothing half-written becomes visible on S3."
            ) from None

    def _within(self, bound: Bound, label: str, make: Callable[[list[float]], Awaitable[T]]) -> T:
        """Run one request's coroutine on a loop of this thread's own, cancelled (its connection
        dropped, no retry sent later) once ``bound.seconds`` passed since it last progressed."""
        progress = [time.monotonic()]

        async def watched() -> T:
            task = asyncio.ensure_future(make(progress))
            while True:
                left = progress[0] + bound.seconds - time.monotonic()
                if left > 0:
                    done, _ = await asyncio.wait({task}, timeout=left)
                    if done:
                        return task.result()
                    continue
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                if bound.stalled is None:
                    bound.stalled = label
                    raise bound.error(f"{self.location}: {label}", first=True)
                raise bound.error("", first=False)

        return asyncio.run(watched())

    def conditional_writes(self, key: str) -> dict[str, bool]:
        """Whether the server honours ``If-None-Match: *`` and ``If-Match`` (store/backends/conditional.py):
        three PUTs of ``key`` (create, create again, replace under a wrong ETag), then its DELETE.
        A refusal by 412 or 409 counts as honoured; a conditional PUT the server took, or refused
        otherwise (501 NotImplemented), as not."""
        check_key(key)

        def put(body: bytes, mode: object) -> None:
            self._call("writing", key, lambda: obstore.put(self._store, key, body, mode=mode), "")  # type: ignore[arg-type]

        put(b"probe 1", "create")
        answers: dict[str, bool] = {}
        try:
            for header, mode in (("If-None-Match", "create"), ("If-Match", {"e_tag": f'"{"0" * 32}"'})):
                try:
                    put(b"probe 2", mode)
                    answers[header] = False
                except ObjectExistsError:
                    answers[header] = True
                except BackendError as exc:
                    answers[header] = any(word in str(exc) for word in ("412", "409", "recondition"))
        finally:
            self._call("deleting", key, lambda: obstore.delete(self._store, key), "")
        return answers

    def _no_bucket(self) -> BackendError:
        bucket = self.location[len("s3://") :].split("/", 1)[0]
        endpoint = self.endpoint or "AWS"
        return BackendError(
            f"{self.location}: the bucket {bucket!r} does not exist on {endpoint} (or these credentials cannot see "
            "it). Create the bucket first, or check AWS_ENDPOINT_URL."
        )

    def put(
        self, key: str, data: BytesLike | Chunks, *, create_only: bool = False, fence: Callable[[], None] | None = None
    ) -> None:
        """One PUT for an object up to ``_SINGLE_PUT`` bytes (most blobs, packs, manifests), a
        multipart upload above: each upload part is a request, and the server joins them.
        ``fence`` is checked after the request's failpoint, just before it is sent."""
        check_key(key)
        chunks = iter(as_chunks(data))
        head: list[bytes] = []
        size = 0
        for chunk in chunks:
            head.append(bytes(chunk) if isinstance(chunk, memoryview) else chunk)  # type: ignore[arg-type]
            size += len(head[-1])
            if size > _SINGLE_PUT:
                break
        mode = "create" if create_only else "overwrite"
        if size <= _SINGLE_PUT:
            whole = head[0] if len(head) == 1 else b"".join(head)
            self._call(
                "writing",
                key,
                lambda: obstore.put(self._store, key, whole, mode=mode, use_multipart=False),
                "put-create" if create_only else "put",
                fence,
                lambda _: obstore.put_async(self._store, key, whole, mode=mode, use_multipart=False),
            )
            return
        rest = (bytes(c) if isinstance(c, memoryview) else c for c in chunks)
        payload = itertools.chain(head, rest)
        self._call(
            "writing",
            key,
            lambda: obstore.put(self._store, key, payload, mode=mode, chunk_size=_PART),
            "put-create" if create_only else "put",
            fence,
            lambda progress: obstore.put_async(
                self._store, key, _advancing(payload, progress), mode=mode, chunk_size=_PART
            ),
        )

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and its ETag, the token ``put_if`` sends as ``If-Match``."""
        check_key(key)

        def fetch() -> tuple[bytes, str]:
            found = obstore.get(self._store, key)
            return bytes(found.bytes()), str(found.meta.get("e_tag") or "")

        return self._call("reading", key, fetch, "get")

    def put_if(self, key: str, data: bytes, version: str, *, fence: Callable[[], None] | None = None) -> bool:
        """One PUT with ``If-Match: version``: the server replaces the object only while it still has
        that ETag, so a host that moved it meanwhile keeps its write. False when it refused."""
        check_key(key)
        if not version:
            return False  # a server that gave no ETag cannot be asked for a conditional replace

        def send() -> bool:
            try:
                obstore.put(self._store, key, data, mode={"e_tag": version}, use_multipart=False)
            except PreconditionError:
                return False
            except FileNotFoundError:
                return False
            return True

        return self._call("writing", key, send, "put-if", fence)

    def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        check_key(key)
        if length is None:
            if start == 0:
                return self._call(
                    "reading", key, lambda: bytes(obstore.get(self._store, key).bytes()), "get", None, self._whole(key)
                )
            length = self.size(key) - start
        if length <= 0:
            return b""

        async def ranged(_: list[float]) -> bytes:
            return bytes(await obstore.get_range_async(self._store, key, start=start, length=length))

        try:
            return self._call(
                "reading",
                key,
                lambda: bytes(obstore.get_range(self._store, key, start=start, length=length)),
                "get",
                None,
                ranged,
            )
        except BackendError as exc:
            if "non-partial response" not in str(exc):
                raise
            # a server that ignores Range (rclone serve s3) sends the whole object: take the range of it
            return self.get(key)[start : start + length]

    def _whole(self, key: str) -> Callable[[list[float]], Awaitable[bytes]]:
        async def whole(_: list[float]) -> bytes:
            return bytes(await (await obstore.get_async(self._store, key)).bytes_async())

        return whole

    def reader(self, key: str, start: int = 0, length: int | None = None) -> BinaryIO:
        check_key(key)
        return GetReader(self, key, start, length)  # type: ignore[return-value]

    def stream(self, key: str, start: int, end: int | None) -> tuple[int, int, Iterator[bytes]]:
        """One GET of ``[start, end)`` (the whole object when ``start`` is 0 and ``end`` is None),
        streamed: the object's size, the end of what the response carries, and its chunks."""
        if (start, end) == (0, None):
            options = None
        else:
            options = {"range": (start, end) if end is not None else {"offset": start}}
        result = self._call("reading", key, lambda: obstore.get(self._store, key, options=options), "get")
        chunks = iter(result.stream(min_chunk_size=READ_CHUNK))
        return int(result.meta["size"]), int(result.range[1]), chunks

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except FileNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        check_key(key)
        head = self._call(
            "reading", key, lambda: obstore.head(self._store, key), "head", None,
            lambda _: obstore.head_async(self._store, key),
        )  # fmt: skip
        return int(head["size"])

    def list(self, prefix: str) -> Iterator[str]:
        for key, _ in self.sizes(prefix):
            yield key

    def sizes(self, prefix: str) -> Iterator[tuple[str, int]]:
        """Every key under ``prefix`` with its size, sorted: one LIST request per 1,000 keys,
        where asking each object's size would cost a HEAD each."""

        def pages() -> list[tuple[str, int]]:
            return [
                (meta["path"], int(meta["size"]))
                for batch in obstore.list(self._store, prefix=prefix or None)
                for meta in batch
            ]

        async def paged(progress: list[float]) -> list[tuple[str, int]]:
            return [(meta["path"], int(meta["size"])) for meta in await self._listed(prefix, progress)]

        yield from sorted(self._call("listing", prefix or "/", pages, "list", None, paged))

    def stamps(self, prefix: str) -> Iterator[tuple[str, float]]:
        """Every key under ``prefix`` with its Last-Modified, as the server's clock gave it (leases
        are timed by it: hosts' clocks may disagree, the server's is one)."""

        def pages() -> list[tuple[str, float]]:
            return [
                (meta["path"], meta["last_modified"].timestamp())
                for batch in obstore.list(self._store, prefix=prefix or None)
                for meta in batch
            ]

        async def paged(progress: list[float]) -> list[tuple[str, float]]:
            return [(meta["path"], meta["last_modified"].timestamp()) for meta in await self._listed(prefix, progress)]

        yield from sorted(self._call("listing", prefix or "/", pages, "list", None, paged))

    async def _listed(self, prefix: str, progress: list[float]) -> list:
        """Every object's metadata under ``prefix``, a page a request, progressing with each page."""
        out = []
        async for batch in obstore.list(self._store, prefix=prefix or None):
            progress[0] = time.monotonic()
            out.extend(batch)
        return out

    def delete(self, key: str) -> None:
        check_key(key)
        self._call(
            "deleting", key, lambda: obstore.delete(self._store, key), "delete", None,
            lambda _: obstore.delete_async(self._store, key),
        )  # fmt: skip

    def delete_many(self, keys: Iterable[str], *, fence: Callable[[], None] | None = None) -> None:
        """S3's DeleteObjects: up to 1,000 keys a request, where a DELETE each is a round trip each
        (a gc that drops a hundred steps deletes thousands of blobs). ``fence`` is called before
        each request: a gc that stalled after its first request and lost its lease meanwhile must
        send no second one (I6, docs/FORMAT.md 8.1)."""
        wanted = [check_key(k) for k in keys]
        for start in range(0, len(wanted), _DELETE_MOST):
            some = wanted[start : start + _DELETE_MOST]
            self._call(
                "deleting",
                f"{some[0]} and {len(some) - 1} more",
                lambda s=some: obstore.delete(self._store, s),
                "delete-many",
                fence,
                lambda _, s=some: obstore.delete_async(self._store, s),
            )

    def batch(self) -> S3Batch:
        return S3Batch(self)

    def leftovers(self) -> list[str]:
        """A conditional-write probe killed before its DELETE (backends/conditional.py), once it is
        old. An unfinished multipart upload is never visible; a bucket lifecycle rule expires it."""
        from tailorstore.store.backends.conditional import PROBE_PREFIX, stale_probes

        return stale_probes(self.stamps(PROBE_PREFIX), time.time())

    def leftover_bytes(self, names: list[str]) -> int:
        return 0  # a probe object is a few bytes

    def clear_leftovers(self, names: list[str]) -> None:
        if names:
            self.delete_many(names)


def _loop_running() -> bool:
    """An event loop runs in this thread (an asyncio caller): a request then runs as it is, unbounded."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _advancing(chunks: Iterable[bytes], progress: list[float]) -> Iterator[bytes]:
    """``chunks``, moving ``progress`` on as the client takes each (a multipart upload's progress)."""
    for chunk in chunks:
        progress[0] = time.monotonic()
        yield chunk


def _unsatisfiable(exc: BaseException) -> bool:
    """S3 answers 416 to a range that starts at or past an object's end (an object cut short)."""
    return "416" in str(exc)


class GetReader(io.RawIOBase):
    """A forward-only file over streamed GETs: the whole range in one request up to
    :data:`_WINDOW` bytes, then one request a window.

    What a blob read costs is round trips: no HEAD first (a reader without a length learns the
    size from its first response), and no request per few megabytes. A response that ends early
    (an object shorter than the range asked for, or a range past its end) ends the reader
    early: the caller sees a short read, and decoding says the blob is damaged. A connection
    that drops mid-body is resumed from where it stopped, twice at most.
    """

    RESUMES = 2

    def __init__(self, backend: S3Backend, key: str, start: int = 0, length: int | None = None) -> None:
        self._backend, self._key = backend, key
        self._pos = start
        self._end = None if length is None else start + length
        self._chunks: Iterator[bytes] | None = None
        self._carried = start  # end of what the open response carries
        self._buf = memoryview(b"")
        self._eof = self._end is not None and length <= 0  # type: ignore[operator]
        self._resumes = 0
        if not self._eof:
            self._open()  # at once, so that a missing object is a FileNotFoundError here

    def readable(self) -> bool:
        return True

    def _open(self) -> None:
        whole = self._pos == 0 and self._end is None
        end = None if whole else (self._pos + _WINDOW if self._end is None else min(self._end, self._pos + _WINDOW))
        try:
            size, self._carried, self._chunks = self._backend.stream(self._key, self._pos, end)
        except BackendError as exc:
            if not _unsatisfiable(exc):
                raise
            self._eof = True
            return
        self._end = size if self._end is None else min(self._end, size)  # a cut-short object ends here
        if whole and size > _WINDOW:
            self._carried = _WINDOW  # take one window of this response, then ranged ones

    def _fill(self) -> None:
        while not self._buf and not self._eof:
            if self._chunks is None:
                if self._end is not None and self._pos >= self._end:
                    self._eof = True
                    return
                self._open()
                continue
            try:
                chunk = next(self._chunks, None)
            except (BaseError, OSError) as exc:
                if self._resumes >= self.RESUMES:
                    raise BackendError(
                        f"{self._backend.location}: reading {self._key} failed ({first_line(exc)}). "
                        "Check that the server is reachable."
                    ) from None
                self._resumes += 1
                self._chunks = None
                continue
            if chunk is None:
                self._chunks = None
                if self._pos < self._carried:  # the response ended before the bytes it announced
                    self._eof = True
                continue
            view = memoryview(chunk)[: self._carried - self._pos]
            self._pos += len(view)
            self._buf = view
            if self._pos >= self._carried:
                self._chunks = None  # past this window (or its one window of a whole-object GET)

    def readinto(self, dest: memoryview | bytearray) -> int:  # type: ignore[override]
        dest = memoryview(dest).cast("B")
        done = 0
        while done < len(dest):
            self._fill()
            if not self._buf:
                break
            n = min(len(dest) - done, len(self._buf))
            dest[done : done + n] = self._buf[:n]
            self._buf = self._buf[n:]
            done += n
        return done


class S3Batch:
    """Every PUT is durable when it returns; deletions wait for ``publish``."""

    def __init__(self, backend: S3Backend) -> None:
        self.backend = backend
        self._deleted: list[str] = []

    def put(self, key: str, chunks: Chunks, size_hint: int = 0) -> None:
        self.backend.put(key, chunks)

    def delete(self, key: str) -> None:
        check_key(key)
        self._deleted.append(key)

    def publish(self, fence: Callable[[], None] | None = None) -> None:
        self.backend.delete_many(self._deleted, fence=fence)
        self._deleted.clear()

    def discard(self) -> None:
        self._deleted.clear()
