"""Row 10 of issue 27: the server-secret file is owner-only from the moment it exists.

The attack: a local user polls the data dir while a gateway starts, and reads the secret in the
moment between the file's creation (umask-default permissions) and a later chmod. The test records
the mode of every file created under the data dir at the instant it is opened (any opener: `os.open`
or `io.open`), with the most permissive umask, and asserts that none was ever readable by others.
"""

from __future__ import annotations

import io
import os
import stat
import threading
from pathlib import Path

import pytest

from gateway.settings import persisted_secret


@pytest.fixture
def open_umask() -> object:
    previous = os.umask(0)  # the worst case: a umask that takes nothing away
    yield
    os.umask(previous)


def test_secret_created_owner_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, open_umask: object
) -> None:
    data_dir = tmp_path / "data"
    modes: dict[str, int] = {}
    real_os_open, real_io_open = os.open, io.open

    def spy_os_open(path: object, flags: int, mode: int = 0o777, *args: object, **kwargs: object) -> int:
        fd = real_os_open(path, flags, mode, *args, **kwargs)  # type: ignore[arg-type]
        if str(path).startswith(str(data_dir)):
            modes[str(path)] = stat.S_IMODE(os.fstat(fd).st_mode)
        return fd

    def spy_io_open(file: object, *args: object, **kwargs: object) -> object:
        handle = real_io_open(file, *args, **kwargs)  # type: ignore[call-overload]
        if isinstance(file, (str, os.PathLike)) and str(file).startswith(str(data_dir)):
            modes.setdefault(str(file), stat.S_IMODE(os.fstat(handle.fileno()).st_mode))
        return handle

    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(io, "open", spy_io_open)
    secret = persisted_secret(data_dir)
    monkeypatch.undo()

    print(
        f"tried: create the server secret under umask 000; saw files opened with modes "
        f"{ {Path(p).name: oct(m) for p, m in modes.items()} }"
    )
    assert modes, "no file creation was observed"
    assert all(m & 0o077 == 0 for m in modes.values()), modes
    path = data_dir / "server_secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == secret and len(secret) == 64
    assert sorted(p.name for p in data_dir.iterdir()) == ["server_secret"]  # no staging file left
    assert persisted_secret(data_dir) == secret  # read back, not replaced


def test_concurrent_creators_share_one_secret(tmp_path: Path) -> None:
    """Gateways starting together on one data dir all end up with the same secret."""
    data_dir = tmp_path / "data"
    results: list[str] = []
    barrier = threading.Barrier(8)

    def create() -> None:
        barrier.wait()
        results.append(persisted_secret(data_dir))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    print(f"tried: 8 concurrent creators; got {len(set(results))} distinct secret(s)")
    assert len(results) == 8 and len(set(results)) == 1
    assert (data_dir / "server_secret").read_text() == results[0]
