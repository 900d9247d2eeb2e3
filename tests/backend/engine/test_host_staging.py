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
