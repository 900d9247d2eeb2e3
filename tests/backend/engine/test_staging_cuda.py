"""The staging buffer's host bytes on CUDA (device tool only): a send's copy is queued on the stream
and reads its pinned host bytes when the stream gets there, so a second send staged before then
must not write them (backend/engine/host_staging.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.engine.host_staging import StagingBuffer

pytestmark = pytest.mark.gpu


def test_two_sends_queued_behind_the_device_each_carry_their_own_bytes() -> None:
    dev = torch.device("cuda")
    st = StagingBuffer(dev)
    landed = []
    torch.cuda._sleep(200_000_000)  # the copies queue behind ~0.1 s of device work
    for value in (1, 2, 3):  # the third send takes the first buffer again: it waits for its copy
        st.start()
        h = st.add(np.full(8, value, dtype=np.int64))
        st.send()
        landed.append(st.view(h).clone())  # ordered on the stream after this send's copy
    torch.cuda.synchronize()
    assert [t.tolist() for t in landed] == [[1] * 8, [2] * 8, [3] * 8]
    assert st.num_waits == 1
