"""The Storage contract on local files, ``memory://`` and a real S3 server (moto), plus the
object-store specifics: aborted writes leave nothing, transient errors are retried and
final ones are not, and the backend keeps working in forked and fresh processes."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from s3server import S3Server, s3_bucket_url, s3_server  # noqa: F401

from shardsafe.storage import LocalStorage, Storage, storage_for
from shardsafe.storage.fsspec import FsspecStorage
from shardsafe.storage.retry import RetryPolicy, call_with_retries, is_transient

pytestmark = pytest.mark.timeout(60)

DATA = bytes(range(256)) * 4 + b"tail"  # 1028 bytes, every offset distinguishable


@pytest.fixture(params=["local", "memory", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Storage]:
    if request.param == "local":
        yield LocalStorage(str(tmp_path / "root"))
    elif request.param == "memory":
        root = FsspecStorage(f"memory://shardsafe-{uuid.uuid4().hex}")
        yield root
        root.remove_tree("")
    else:
        yield FsspecStorage(request.getfixturevalue("s3_bucket_url"), backoff=0.001)


@pytest.fixture(params=["memory", "s3"])
def object_storage(request: pytest.FixtureRequest) -> Iterator[FsspecStorage]:
    if request.param == "memory":
        root = FsspecStorage(f"memory://shardsafe-{uuid.uuid4().hex}")
        yield root
        root.remove_tree("")
    else:
        yield FsspecStorage(request.getfixturevalue("s3_bucket_url"), backoff=0.001)


@pytest.fixture
def s3(s3_bucket_url: str) -> FsspecStorage:  # noqa: F811
    return FsspecStorage(s3_bucket_url, retries=3, backoff=0.001)


# -- the contract, on every backend -------------------------------------------------------


def test_write_read_roundtrip(storage: Storage) -> None:
    storage.write_bytes("ck/a/data.bin", DATA)
    assert storage.exists("ck/a/data.bin")
    assert storage.size("ck/a/data.bin") == len(DATA)
    assert storage.read_bytes("ck/a/data.bin") == DATA
    assert storage.exists("ck/a") and storage.is_dir("ck/a") and storage.is_dir("ck")
    assert not storage.is_dir("ck/a/data.bin")
    assert not storage.exists("ck/missing") and not storage.is_dir("ck/missing")


def test_open_write_streams_pieces(storage: Storage) -> None:
    floats = np.arange(300, dtype=np.float32)
    storage.make_dir("ck")
    with storage.open_write("ck/stream.bin") as f:
        f.write(b"head")
        f.write(memoryview(floats))
        f.write(bytearray(b"end"))
    assert storage.read_bytes("ck/stream.bin") == b"head" + floats.tobytes() + b"end"
    with storage.open_write("ck/empty.bin"):
        pass
    assert storage.exists("ck/empty.bin") and storage.size("ck/empty.bin") == 0


@pytest.mark.parametrize(("offset", "length"), [(0, 1028), (0, 1), (1, 300), (700, 328), (5, 0)])
def test_read_into_ranges(storage: Storage, offset: int, length: int) -> None:
    storage.write_bytes("data.bin", DATA)
    buf = bytearray(length)
    storage.read_into("data.bin", offset, memoryview(buf))
    assert bytes(buf) == DATA[offset : offset + length]


def test_read_into_typed_buffer(storage: Storage) -> None:
    values = np.linspace(-1, 1, 64, dtype=np.float32)
    storage.write_bytes("f32.bin", b"\0" * 12 + values.tobytes())
    out = np.empty(64, dtype=np.float32)
    storage.read_into("f32.bin", 12, memoryview(out))  # format "f", cast to bytes inside
    np.testing.assert_array_equal(out, values)


@pytest.mark.parametrize(
    ("offset", "length"), [(1000, 100), (1028, 1), (5000, 10)], ids=["crosses", "at", "past"]
)
def test_short_read_raises_eof(storage: Storage, offset: int, length: int) -> None:
    storage.write_bytes("data.bin", DATA)
    with pytest.raises(EOFError, match=r"data\.bin"):
        storage.read_into("data.bin", offset, memoryview(bytearray(length)))


def test_missing_object_raises_file_not_found(storage: Storage) -> None:
    storage.write_bytes("present", b"x")
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("absent")
    with pytest.raises(FileNotFoundError):
        storage.read_into("absent", 0, memoryview(bytearray(4)))
    with pytest.raises(FileNotFoundError):
        storage.size("absent")


def test_list_dir(storage: Storage) -> None:
    for rel in ("x", "y", "d/z", "d/e/f", "dd/g"):
        storage.write_bytes(rel, rel.encode())
    assert storage.list_dir("") == ["d", "dd", "x", "y"]
    assert storage.list_dir("d") == ["e", "z"]
    assert storage.list_dir("d/e") == ["f"]
    assert storage.list_dir("missing") == []
    assert storage.list_dir("x") == []


def test_remove_tree(storage: Storage) -> None:
    for rel in ("ck/a/1", "ck/a/2/3", "ck/ab/1", "ck/b", "other"):
        storage.write_bytes(rel, b"z")
    storage.remove_tree("ck/a")
    assert storage.list_dir("ck") == ["ab", "b"], "a sibling sharing the prefix must survive"
    storage.remove_tree("ck/b")  # a single object
    storage.remove_tree("ck/missing")  # missing is fine
    assert storage.list_dir("ck") == ["ab"]
    storage.remove_tree("ck")
    assert not storage.exists("ck") and storage.list_dir("") == ["other"]


def test_create_exclusive(storage: Storage) -> None:
    assert storage.create_exclusive("ck/LOCK", b"first")
    assert not storage.create_exclusive("ck/LOCK", b"second")
    assert storage.read_bytes("ck/LOCK") == b"first"


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_create_exclusive_has_one_winner(backend: str, request: pytest.FixtureRequest) -> None:
    """Concurrent creators: exactly one wins (S3 relies on the conditional put here)."""
    if backend == "local":
        root: Storage = LocalStorage(str(request.getfixturevalue("tmp_path")))
    else:
        root = FsspecStorage(request.getfixturevalue("s3_bucket_url"))

    def contend(i: int, rel: str, barrier: threading.Barrier, wins: list[int]) -> None:
        barrier.wait()
        if root.create_exclusive(rel, str(i).encode()):
            wins.append(i)

    for round_ in range(5):
        barrier = threading.Barrier(8)
        wins: list[int] = []
        threads = [
            threading.Thread(target=contend, args=(i, f"marker-{round_}", barrier, wins))
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1, wins
        assert root.read_bytes(f"marker-{round_}") == str(wins[0]).encode()


def test_storage_for_dispatch(tmp_path: Any, s3_bucket_url: str) -> None:  # noqa: F811
    assert isinstance(storage_for(str(tmp_path)), LocalStorage)
    assert isinstance(storage_for(f"file://{tmp_path}"), LocalStorage)
    s3 = storage_for(s3_bucket_url)
    assert isinstance(s3, FsspecStorage) and not s3.atomic_rename
    assert s3.storage_options["endpoint_url"] == os.environ["SHARDSAFE_S3_ENDPOINT_URL"]
    assert isinstance(storage_for("memory://shardsafe-dispatch"), FsspecStorage)


# -- object-store specifics ------------------------------------------------------------------


def test_open_write_that_raises_leaves_no_object(object_storage: FsspecStorage) -> None:
    with pytest.raises(RuntimeError, match="boom"), object_storage.open_write("ck/x.bin") as f:
        f.write(b"partial")
        raise RuntimeError("boom")
    assert not object_storage.exists("ck/x.bin")
    assert object_storage.list_dir("") == []


def test_aborted_multipart_upload_leaves_nothing(s3_server: S3Server, s3_bucket_url: str) -> None:  # noqa: F811
    part = 5 << 20  # S3's smallest part
    root = FsspecStorage(s3_bucket_url, {"default_block_size": part})
    prefix = s3_bucket_url.split("/", 3)[3]
    client = s3_server.client()
    blob = os.urandom(2 * part + 123)

    with pytest.raises(KeyboardInterrupt), root.open_write("big.bin") as f:
        f.write(blob[: part + 1])  # fills a block: a multipart upload is now in flight
        raise KeyboardInterrupt
    assert not root.exists("big.bin")
    pending = client.list_multipart_uploads(Bucket=s3_server.bucket, Prefix=prefix)
    assert not pending.get("Uploads"), "the multipart upload must be aborted"

    with root.open_write("big.bin") as f:  # and a clean multipart upload round-trips
        for i in range(0, len(blob), 1 << 20):
            f.write(blob[i : i + (1 << 20)])
    assert root.size("big.bin") == len(blob)
    out = bytearray(part + 10)
    root.read_into("big.bin", part - 5, memoryview(out))  # spans a part boundary
    assert bytes(out) == blob[part - 5 : 2 * part + 5]


def test_read_into_in_chunks(object_storage: FsspecStorage) -> None:
    object_storage.read_chunk_size = 64
    object_storage.write_bytes("data.bin", DATA)
    out = bytearray(500)  # 8 ranged reads
    object_storage.read_into("data.bin", 3, memoryview(out))
    assert bytes(out) == DATA[3:503]
    with pytest.raises(EOFError, match="ends after 25"):
        object_storage.read_into("data.bin", 1003, memoryview(bytearray(40)))


def test_root_removal_keeps_bucket(s3_server: S3Server, s3_bucket_url: str) -> None:  # noqa: F811
    root = FsspecStorage(s3_bucket_url)
    root.write_bytes("a/b", b"1")
    root.write_bytes("c", b"2")
    root.remove_tree("")
    assert root.list_dir("") == []
    s3_server.client().head_bucket(Bucket=s3_server.bucket)


def test_paths_stay_under_root(object_storage: FsspecStorage) -> None:
    for bad in ("../escape", "a/../../b", "/abs"):
        with pytest.raises(ValueError):
            object_storage.path(bad)


def test_missing_backend_names_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardsafe.storage.fsspec as mod

    def no_backend(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(mod.fsspec.core, "url_to_fs", no_backend)
    with pytest.raises(ImportError, match=r"pip install 'shardsafe\[s3\]'"):
        FsspecStorage("s3://bucket/prefix")


# -- retries (faults injected into a real server's client) ------------------------------------


class Flaky:
    """Wraps a filesystem method: the first ``failures`` calls raise, later ones pass through."""

    def __init__(
        self, fn: Callable[..., Any], failures: int, error: Callable[[], BaseException]
    ) -> None:
        self.fn, self.failures, self.error = fn, failures, error
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error()
        return self.fn(*args, **kwargs)


def s3_error(status: int, code: str) -> BaseException:
    """What s3fs raises for an S3 error reply: a translated OSError caused by a ClientError.

    Skips the calling test where s3fs (and its botocore) is not installed."""
    ClientError = pytest.importorskip("botocore.exceptions").ClientError
    translate_boto_error = pytest.importorskip("s3fs.errors").translate_boto_error

    reply: Any = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return translate_boto_error(ClientError(reply, "GetObject"))


def inject(
    monkeypatch: pytest.MonkeyPatch,
    root: FsspecStorage,
    method: str,
    failures: int,
    error: Callable[[], BaseException],
) -> Flaky:
    flaky = Flaky(getattr(root.fs, method), failures, error)
    monkeypatch.setattr(root.fs, method, flaky)
    return flaky


@pytest.mark.parametrize(
    "error",
    [
        lambda: s3_error(503, "SlowDown"),
        lambda: s3_error(500, "InternalError"),
        lambda: s3_error(400, "RequestTimeout"),
        lambda: ConnectionResetError(104, "Connection reset by peer"),
        lambda: TimeoutError("read timed out"),
    ],
    ids=["503-slowdown", "500", "400-request-timeout", "reset", "timeout"],
)
def test_transient_read_error_is_retried(
    s3: FsspecStorage, monkeypatch: pytest.MonkeyPatch, error: Callable[[], BaseException]
) -> None:
    s3.write_bytes("data.bin", DATA)
    flaky = inject(monkeypatch, s3, "cat_file", 2, error)
    out = bytearray(100)
    s3.read_into("data.bin", 10, memoryview(out))
    assert bytes(out) == DATA[10:110]
    assert flaky.calls == 3


def test_transient_write_error_is_retried(
    s3: FsspecStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    flaky = inject(monkeypatch, s3, "pipe_file", 1, lambda: s3_error(503, "SlowDown"))
    s3.write_bytes("w.bin", b"payload")
    assert flaky.calls == 2 and s3.read_bytes("w.bin") == b"payload"


def test_missing_object_is_not_retried(s3: FsspecStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    cat = inject(monkeypatch, s3, "cat_file", 0, RuntimeError)
    info = inject(monkeypatch, s3, "info", 0, RuntimeError)
    with pytest.raises(FileNotFoundError):
        s3.read_bytes("absent")  # a real 404 from the server
    with pytest.raises(FileNotFoundError):
        s3.size("absent")
    assert not s3.exists("absent")
    assert cat.calls == 1 and info.calls == 2


def test_forbidden_is_not_retried(s3: FsspecStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    flaky = inject(monkeypatch, s3, "cat_file", 100, lambda: s3_error(403, "AccessDenied"))
    with pytest.raises(PermissionError):
        s3.read_bytes("anything")
    assert flaky.calls == 1


def test_retries_give_up(s3: FsspecStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    flaky = inject(monkeypatch, s3, "cat_file", 100, lambda: s3_error(503, "SlowDown"))
    with pytest.raises(OSError, match="SlowDown"):
        s3.read_bytes("anything")
    assert flaky.calls == 1 + s3.retry.retries


def test_create_exclusive_after_lost_reply(
    s3: FsspecStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put landed but its reply was lost: the retry sees our own object and reports success."""
    real = s3.fs.pipe_file
    calls = 0

    def put_then_drop_reply(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        result = real(*args, **kwargs)
        if calls == 1:
            raise ConnectionResetError(104, "reply lost")
        return result

    monkeypatch.setattr(s3.fs, "pipe_file", put_then_drop_reply)
    assert s3.create_exclusive("MARKER", b"mine")
    assert calls == 2
    assert not s3.create_exclusive("MARKER", b"mine")


def test_retry_policy_backs_off_exponentially() -> None:
    policy = RetryPolicy(retries=4, backoff=0.2, max_backoff=1.0)
    for attempt, cap in enumerate([0.2, 0.4, 0.8, 1.0, 1.0]):
        assert cap / 2 <= policy.delay(attempt) <= cap
    waits: list[float] = []
    attempts = Flaky(lambda: "done", 3, lambda: ConnectionResetError())
    assert call_with_retries(attempts, policy, "op", sleep=waits.append) == "done"
    assert len(waits) == 3 and waits[0] <= 0.2 < waits[2]


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (lambda: s3_error(503, "SlowDown"), True),
        (lambda: s3_error(500, "InternalError"), True),
        (lambda: s3_error(429, "TooManyRequests"), True),
        (lambda: s3_error(400, "RequestTimeout"), True),
        (lambda: s3_error(404, "NoSuchKey"), False),
        (lambda: s3_error(403, "AccessDenied"), False),
        (lambda: s3_error(412, "PreconditionFailed"), False),
        (lambda: s3_error(400, "InvalidArgument"), False),
        (lambda: ConnectionRefusedError(), True),
        (lambda: TimeoutError(), True),
        (lambda: FileNotFoundError("x"), False),
        (lambda: ValueError("bug"), False),
    ],
)
def test_is_transient(error: Callable[[], BaseException], transient: bool) -> None:
    assert is_transient(error()) is transient


# -- processes ----------------------------------------------------------------------------------


def _child_round_trip(root: FsspecStorage, rel: str) -> None:
    root.write_bytes(rel, root.read_bytes("parent") + b"+child")


def test_usable_after_fork_and_pickle(s3_bucket_url: str) -> None:  # noqa: F811
    """A forked rank inherits a live client bound to the parent's event loop; it must not use it."""
    root = FsspecStorage(s3_bucket_url)
    root.write_bytes("parent", b"p")  # the parent's client is now live

    proc = multiprocessing.get_context("fork").Process(
        target=_child_round_trip, args=(root, "forked")
    )
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    assert root.read_bytes("forked") == b"p+child"

    clone = pickle.loads(pickle.dumps(root))  # what a spawned rank receives
    assert clone._fs is None
    _child_round_trip(clone, "unpickled")
    assert root.read_bytes("unpickled") == b"p+child"


@pytest.mark.slow
def test_fresh_interpreter_finds_server_through_env(s3_bucket_url: str) -> None:  # noqa: F811
    """A new interpreter (like a spawned rank) reaches the server from the environment alone."""
    root = FsspecStorage(s3_bucket_url)
    root.write_bytes("parent", b"p")
    code = (
        "import sys; from shardsafe.storage import storage_for; "
        "s = storage_for(sys.argv[1]); s.write_bytes('fresh', s.read_bytes('parent') + b'+new')"
    )
    subprocess.run([sys.executable, "-c", code, s3_bucket_url], check=True, timeout=50)
    assert root.read_bytes("fresh") == b"p+new"
