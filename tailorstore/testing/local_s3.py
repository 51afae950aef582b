"""A real S3 server on 127.0.0.1 for tests and benchmarks: moto's ``ThreadedMotoServer``.

It speaks the S3 wire protocol (conditional puts included), so the S3 backend is tested
exactly as it talks to AWS, and nothing leaves this machine. Clients find it through the
standard AWS environment variables, which :meth:`LocalS3.environ` lists.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import boto3
from moto.server import ThreadedMotoServer

BUCKET = "tailor-test"


class LocalS3:
    def __init__(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint = ""

    def start(self) -> LocalS3:
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        boto3.client("s3", **self._client_args()).create_bucket(Bucket=BUCKET)
        return self

    def stop(self) -> None:
        self._server.stop()

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
