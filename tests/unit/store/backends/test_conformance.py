"""One conformance suite for every backend (store/backends/): :class:`BackendTests`, as zarr's
``StoreTests``. What the store relies on is checked here, once per backend: each backend's
subclass provides the ``backend`` fixture, an empty backend of its kind, and inherits every check.
The POSIX directory, and S3 on each local server its file runs on (conftest's ``s3_kinds``: moto,
and SeaweedFS too, this file being one of ``ON_BOTH``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tailorstore.core.errors import ObjectExistsError, StoreError
from tailorstore.core.object_keys import blob_key
from tailorstore.store.backends.base import READ_CHUNK, Backend, blob_names, check_key
from tailorstore.store.backends.location import resolve


class BackendTests:
    """The checks every :class:`Backend` passes. A subclass named ``Test...`` provides ``backend``."""

    @pytest.fixture
    def backend(self) -> Backend:
        raise NotImplementedError("a backend's subclass of BackendTests provides the backend fixture")

    def test_put_and_get_whole_and_ranged(self, backend: Backend) -> None:
        data = os.urandom(100_000)
        backend.put("x/one", data)
        assert backend.get("x/one") == data
        assert backend.get("x/one", 10, 20) == data[10:30]
        assert backend.get("x/one", 99_990) == data[99_990:]
        assert backend.size("x/one") == 100_000 and backend.exists("x/one")

    def test_put_from_chunks_including_reused_memoryviews(self, backend: Backend) -> None:
        buf = bytearray(1000)
        expected = b""

        def chunks() -> Iterator[memoryview]:
            nonlocal expected
            for i in range(5):
                buf[:] = bytes([i]) * 1000  # the same buffer, refilled: a put must copy what it keeps
                expected += bytes(buf)
                yield memoryview(buf)

        backend.put("x/chunked", chunks())
        assert backend.get("x/chunked") == expected

    def test_reader_streams_ranges_across_chunk_boundaries(self, backend: Backend) -> None:
        data = os.urandom(READ_CHUNK + 12_345)
        backend.put("x/big", data)
        with backend.reader("x/big") as f:
            first = f.read(READ_CHUNK - 7)
            rest = f.read()
        assert first + rest == data
        with backend.reader("x/big", 5000, READ_CHUNK) as f:
            assert f.read() == data[5000 : 5000 + READ_CHUNK]
        with backend.reader("x/big", 4097, 3) as f:  # an unaligned range inside one page
            assert f.read(100) == data[4097:4100]

    def test_a_range_past_the_end_reads_short_and_never_fails_or_hangs(self, backend: Backend) -> None:
        """A reader bounded by what the index says reads what the object holds: an object cut
        short (or emptied) gives a short read, which decoding reports as a damaged blob."""
        backend.put("x/ten", b"0123456789")
        backend.put("x/empty", b"")
        with backend.reader("x/ten", 5, 100) as f:
            assert f.read() == b"56789"
        for start in (10, 20):
            with backend.reader("x/ten", start, 5) as f:
                assert f.read() == b""
        with backend.reader("x/empty") as f:
            assert f.read() == b""
        with backend.reader("x/empty", 0, 10) as f:
            assert f.read() == b""

    @pytest.mark.slow  # seconds: the fast tier keeps its minute
    def test_an_object_above_the_single_put_limit_goes_up_whole(self, backend: Backend) -> None:
        """70 MiB from chunks: above S3's one-PUT limit (64 MiB), so a multipart upload there; it reads
        back whole and across the reader's chunk boundaries."""
        piece = os.urandom(1 << 20)
        backend.put("x/large", (memoryview(piece) for _ in range(70)))
        assert backend.size("x/large") == 70 << 20
        with backend.reader("x/large") as f:
            assert f.read() == piece * 70
        with backend.reader("x/large", (32 << 20) - 3, 6) as f:
            assert f.read() == piece[-3:] + piece[:3]

    def test_create_only_never_replaces(self, backend: Backend) -> None:
        backend.put("m/1", b"first", create_only=True)
        with pytest.raises(ObjectExistsError):
            backend.put("m/1", b"second", create_only=True)
        assert backend.get("m/1") == b"first"
        backend.put("m/1", b"third")  # a plain put replaces
        assert backend.get("m/1") == b"third"

    def test_put_if_replaces_only_what_was_read(self, backend: Backend) -> None:
        """A ref dropped while another host may move it: replaced only while it says what was read."""
        backend.put("r/tag", b"names step 1")
        data, version = backend.get_versioned("r/tag")
        assert data == b"names step 1"
        backend.put("r/tag", b"names step 2")  # another host moved it meanwhile
        assert backend.put_if("r/tag", b"dropped", version) is False
        assert backend.get("r/tag") == b"names step 2"
        _, now = backend.get_versioned("r/tag")
        assert backend.put_if("r/tag", b"dropped", now) is True
        assert backend.get("r/tag") == b"dropped"
        backend.delete("r/tag")
        assert backend.put_if("r/tag", b"dropped", now) is False and not backend.exists("r/tag")
        with pytest.raises(FileNotFoundError):
            backend.get_versioned("r/tag")

    def test_missing_objects_raise_file_not_found(self, backend: Backend) -> None:
        calls = (lambda: backend.get("no/such"), lambda: backend.size("no/such"), lambda: backend.reader("no/such"))
        for call in calls:
            with pytest.raises(FileNotFoundError):
                call()
        assert not backend.exists("no/such")
        backend.delete("no/such")  # deleting what is gone is not an error

    def test_list_under_a_prefix_sorted(self, backend: Backend) -> None:
        for key in ("b/2", "a/1", "b/1", "bb/3", "b/sub/4"):
            backend.put(key, key.encode())
        assert list(backend.list("b/")) == ["b/1", "b/2", "b/sub/4"]
        assert list(backend.list("")) == ["a/1", "b/1", "b/2", "b/sub/4", "bb/3"]
        assert list(backend.list("nothing/")) == []
        backend.delete("b/1")
        assert list(backend.list("b/")) == ["b/2", "b/sub/4"]

    def test_sizes_list_each_key_with_its_size(self, backend: Backend) -> None:
        for key, size in (("b/2", 7), ("a/1", 0), ("b/1", 3 << 20), ("b/sub/4", 1)):
            backend.put(key, b"z" * size)
        assert list(backend.sizes("b/")) == [("b/1", 3 << 20), ("b/2", 7), ("b/sub/4", 1)]
        assert dict(backend.sizes("")) == {key: backend.size(key) for key in backend.list("")}
        assert list(backend.sizes("nothing/")) == []

    def test_delete_many_deletes_those_keys_and_no_other(self, backend: Backend) -> None:
        keys = [blob_key(f"{i:02x}" * 16) for i in range(12)]
        for key in keys:
            backend.put(key, b"k")
        backend.put("keep/me", b"k")
        backend.delete_many([*keys[:10], blob_key("e" * 32)])  # a key already gone is not an error
        assert list(backend.list("")) == [*keys[10:], "keep/me"]
        backend.delete_many([])

    def test_a_failed_put_leaves_no_object(self, backend: Backend) -> None:
        def failing() -> Iterator[bytes]:
            yield b"x" * (6 << 20)
            yield b"y" * (6 << 20)  # past one multipart part on S3
            raise OSError("the input went away")

        with pytest.raises((OSError, StoreError)):
            backend.put("x/half", failing())
        assert not backend.exists("x/half")
        assert list(backend.list("x/")) == []
        assert backend.leftovers() == []

    def test_batch_publishes_puts_and_deletes_together(self, backend: Backend) -> None:
        backend.put(blob_key("0" * 32), b"old")
        batch = backend.batch()
        batch.put(blob_key("a" * 32), [b"new ", memoryview(b"blob")], 8)
        batch.delete(blob_key("0" * 32))
        assert backend.exists(blob_key("0" * 32)), "a delete waits for publish"
        batch.publish()
        assert backend.get(blob_key("a" * 32)) == b"new blob"
        assert not backend.exists(blob_key("0" * 32))
        assert list(blob_names(backend)) == ["a" * 32]

    def test_discarded_batch_publishes_nothing_and_leaves_no_temp_files(self, backend: Backend) -> None:
        batch = backend.batch()
        batch.delete("keep")
        backend.put("keep", b"k")
        batch.put(blob_key("b" * 32), [b"x"], 1)
        batch.discard()
        assert backend.exists("keep")
        assert backend.leftovers() == []

    def test_blob_names_skip_foreign_objects(self, backend: Backend) -> None:
        backend.put(blob_key("c" * 32), b"c")
        backend.put("blobs/cc/not-a-hash", b"?")
        backend.put(f"blobs/dd/{'c' * 32}", b"misfiled")
        assert list(blob_names(backend)) == ["c" * 32]

    @pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "a/../b", "", "a\\b", "a b"])
    def test_unsafe_keys_are_refused(self, backend: Backend, key: str) -> None:
        with pytest.raises(StoreError):
            check_key(key)
        with pytest.raises(StoreError):
            backend.put(key, b"x")


class TestPosixBackend(BackendTests):
    """A directory on the local file system."""

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        return resolve(tmp_path / "store").backend


class TestS3Backend(BackendTests):
    """A fresh prefix on a local S3 server: once per server this file runs on (``s3_kind``)."""

    @pytest.fixture
    def backend(self, s3_location: str) -> Backend:
        return resolve(s3_location).backend
