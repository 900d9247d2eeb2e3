"""The staging buffer: a step's arrays cross in one copy, typed, aligned, whole after it grows."""

from __future__ import annotations

import numpy as np
import torch

from backend.engine.host_staging import StagingBuffer


def test_staging_keeps_what_was_written_when_it_grows() -> None:
    st = StagingBuffer(torch.device("cpu"), capacity=64)
    st.start()
    small = st.add(np.arange(4, dtype=np.int32))
    handle, view = st.reserve(np.int64, (3, 5))  # past the capacity: the buffer grows
    view[...] = np.arange(15).reshape(3, 5)
    flags = st.add(np.array([True, False]))
    st.send()
    assert st.view(small).tolist() == [0, 1, 2, 3] and st.view(flags).tolist() == [True, False]
    assert st.view(handle).tolist() == np.arange(15).reshape(3, 5).tolist()
    assert all(st.view(h).data_ptr() % 64 == 0 for h in (small, handle, flags))  # aligned for kernels


def test_a_second_send_never_writes_the_host_bytes_of_the_first() -> None:
    """One step may send twice before reading anything back (chained draft depths): on CUDA the
    first copy reads its host bytes only when the stream reaches it, so the second send stages into
    the other host buffer and leaves the first's bytes as they were (CPU: the buffers in turn alone,
    the copies being synchronous; the CUDA race itself: test_staging_cuda)."""
    st = StagingBuffer(torch.device("cpu"), capacity=64, num_host_buffers=2)
    st.start()
    _, first = st.reserve(np.int64, (4,))
    first[...] = 1
    st.send()
    st.start()
    _, second = st.reserve(np.int64, (4,))
    second[...] = 2
    assert first.tolist() == [1] * 4  # what the first copy reads, whenever it runs
    big = st.add(np.arange(40, dtype=np.int64))  # this buffer grows past the device's: both grow
    st.send()
    assert st.view(big).tolist() == list(range(40))
    st.start()  # the first buffer again, and a send from it after the other grew
    h = st.add(np.full(40, 3, dtype=np.int64))
    st.send()
    assert st.view(h).tolist() == [3] * 40
