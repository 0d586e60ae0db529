"""A local S3 server for the embedded broker to keep its topics in.

Why: the Tansu build the tests use stores topics in memory or in S3 only, so a broker stopped and
started again forgot every topic, record and committed offset, and "the broker restarts; nothing
is lost" could not be tested. moto's S3 server (a development dependency) runs as a process on a
loopback port; Tansu with `--storage-engine s3://BUCKET/` keeps everything there, and a new broker
process on the same store finds it all again. It lives as long as this object, not on disk.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from types import TracebackType

from mmworker.devkit.broker import BrokerError, free_port, terminate

BUCKET = "tansu"
#: Any credentials do for moto; the region must be one S3 knows.
_ENV = {
    "AWS_ACCESS_KEY_ID": "mmworker",
    "AWS_SECRET_ACCESS_KEY": "mmworker",
    "AWS_DEFAULT_REGION": "eu-west-2",
    "AWS_ALLOW_HTTP": "true",
}


class ObjectStore:
    def __init__(self, start_timeout_s: float = 30.0) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server

    @property
    def storage_engine(self) -> str:
        """Tansu's `--storage-engine` for this store."""
        return f"s3://{BUCKET}/"

    def env(self) -> dict[str, str]:
        """What Tansu reads to reach the store (object_store's AWS variables)."""
        return {**_ENV, "AWS_ENDPOINT": self.endpoint}

    def start(self) -> ObjectStore:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._log.seek(0)
                raise BrokerError(f"moto's S3 server exited: {self._log.read()[-2000:]!r}")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                self._create_bucket()
                return self
            time.sleep(0.1)
        self.stop()
        raise BrokerError(f"moto's S3 server did not listen on {self.endpoint}")

    def _create_bucket(self) -> None:
        import boto3

        s3 = boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=_ENV["AWS_DEFAULT_REGION"],
            aws_access_key_id=_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=_ENV["AWS_SECRET_ACCESS_KEY"],
        )  # fmt: skip
        s3.create_bucket(
            Bucket=BUCKET,
            CreateBucketConfiguration={"LocationConstraint": _ENV["AWS_DEFAULT_REGION"]},
        )

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        terminate(proc)

    def __enter__(self) -> ObjectStore:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._log.close()
