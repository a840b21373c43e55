"""A real S3-compatible server on 127.0.0.1 for tests: moto in server mode.

The server runs in a child process (moto's ``ThreadedMotoServer`` on an ephemeral port)
rather than a thread of the test process: a thread would share the GIL with the code under
test and would be inherited half-alive by ranks started with ``fork``. The child reports
its port on stdout and exits when its stdin closes, so it also dies with a crashed pytest.

While the server is up, ``os.environ`` carries fake credentials and the endpoint
(``AWS_ENDPOINT_URL``, ``SHARDSAFE_S3_ENDPOINT_URL``), so any process started from the
tests (spawned or forked ranks included) reaches it with plain ``s3://bucket/prefix`` URLs.

Use from ``tests/conftest.py``::

    from s3server import s3_bucket_url, s3_server, s3_url  # noqa: F401

then ask for ``s3_bucket_url`` (or its alias ``s3_url``) in a test: a fresh
``s3://shardsafe-test/<unique prefix>`` per test on a server shared by the session.
Outside pytest, ``with S3Server() as server: server.url("prefix")``.
Tests that ask for these fixtures are skipped when ``moto[server]`` or ``s3fs`` is missing.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import pytest

BUCKET = "shardsafe-test"

# Runs in the child: serve until the parent closes our stdin (or dies).
_CHILD = """
import logging, sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address=sys.argv[1], port=0, verbose=False)
server.start()
print("PORT", server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""

_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# Real credentials or profiles in the environment must not leak into (or redirect) tests.
_UNSET = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3")


class S3Server:
    """A moto S3 server in a child process, with one bucket, and the env pointing at it."""

    def __init__(
        self, bucket: str = BUCKET, host: str = "127.0.0.1", start_timeout: float = 60.0
    ) -> None:
        self.bucket = bucket
        self.host = host
        self.start_timeout = start_timeout
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None
        self._saved_env: dict[str, str | None] = {}
        self._client: Any = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs in its environment to reach this server."""
        return {
            **_CREDENTIALS,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "SHARDSAFE_S3_ENDPOINT_URL": self.endpoint_url,
        }

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def client(self) -> Any:
        """A plain boto3 client on this server, for setup and inspection (made once: ~0.3 s)."""
        if self._client is None:
            import boto3

            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name="us-east-1",
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
            )
        return self._client

    def start(self) -> S3Server:
        if self._proc is not None:
            return self
        with tempfile.TemporaryFile(mode="w+") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, self.host],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            try:
                self.port = self._read_port()
                self._set_env()
                self.client().create_bucket(Bucket=self.bucket)
            except BaseException as e:
                self.stop()
                log.seek(0)
                raise RuntimeError(f"moto server did not start: {e}\n{log.read()[-4000:]}") from e
        return self

    def _read_port(self) -> int:
        assert self._proc is not None and self._proc.stdout is not None
        line: list[str] = []
        reader = threading.Thread(
            target=lambda: line.append(self._proc.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        reader.join(self.start_timeout)
        if not line or not line[0].startswith("PORT "):
            raise TimeoutError(f"no port reported within {self.start_timeout}s: {line!r}")
        return int(line[0].split()[1])

    def _set_env(self) -> None:
        no_proxy = os.environ.get("NO_PROXY", "")
        extra = {**self.env, "NO_PROXY": ",".join(p for p in (no_proxy, self.host) if p)}
        extra["no_proxy"] = extra["NO_PROXY"]
        for name in (*extra, *_UNSET):
            self._saved_env.setdefault(name, os.environ.get(name))
        for name in _UNSET:
            os.environ.pop(name, None)
        os.environ.update(extra)

    def _restore_env(self) -> None:
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env.clear()

    def stop(self) -> None:
        """Close the child's stdin so it shuts down; terminate it if it lingers."""
        proc, self._proc = self._proc, None
        self._client = None
        self._restore_env()
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def delete_prefix(self, prefix: str) -> None:
        """Best-effort removal of everything under ``prefix`` (keeps the server's memory small)."""
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix.rstrip("/") + "/"
        ):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# One server per process, shared even when these fixtures are imported into several
# modules (each import defines its own fixture, but they all land on this instance).
_lock = threading.Lock()
_shared: S3Server | None = None
_users = 0


def acquire_server() -> S3Server:
    global _shared, _users
    with _lock:
        if _shared is None:
            _shared = S3Server().start()
        _users += 1
        return _shared


def release_server() -> None:
    global _shared, _users
    with _lock:
        _users -= 1
        if _users == 0 and _shared is not None:
            _shared.stop()
            _shared = None


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session's moto server (skips when moto[server] or s3fs is not installed)."""
    pytest.importorskip("moto.server", reason="needs moto[server]")
    pytest.importorskip("s3fs", reason="needs s3fs")
    server = acquire_server()
    try:
        yield server
    finally:
        release_server()


@pytest.fixture
def s3_bucket_url(s3_server: S3Server) -> Iterator[str]:
    """``s3://bucket/<unique prefix>``, emptied after the test."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    yield s3_server.url(prefix)
    with contextlib.suppress(Exception):  # cleanup only; the server dies with the session
        s3_server.delete_prefix(prefix)


@pytest.fixture
def s3_url(s3_bucket_url: str) -> str:
    """Alias of ``s3_bucket_url``."""
    return s3_bucket_url
