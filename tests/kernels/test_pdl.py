"""Programmatic Dependent Launch (`kernels/triton_lib.py`): the switch and where it lets PDL on; every
PDL kernel lowered for sm90 against the rules there (on the CPU: its PTX and machine code); and on a
GPU, a CUDA graph captured over PDL launches holds programmatic edges and replays, bit for bit, what
the same graph without PDL computes. The decode step with PDL on and off is
tests/backend/engine/test_pdl_decode_cuda.py.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable, Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels import triton_lib  # noqa: E402
from kernels.triton_lib import pdl_args, set_pdl  # noqa: E402
from tests.kernels.sm90_compile import compiled_lines  # noqa: E402
from tests.kernels.sm90_compile_pdl import PREFETCH  # noqa: E402

CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1


@pytest.fixture
def fresh_gate() -> Iterator[None]:
    """The capability cache emptied around the test and the switch restored after it."""
    was = triton_lib.PDL_ENABLED
    triton_lib._can_pdl.cache_clear()
    yield
    set_pdl(was)
    triton_lib._can_pdl.cache_clear()


def test_pdl_only_on_cuda_from_compute_capability_9_while_the_switch_is_on(
    fresh_gate: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert pdl_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    capability = {0: (8, 0), 1: (9, 0), 2: (10, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[device.index])
    assert [pdl_args(torch.device("cuda", i))["PDL"] for i in range(3)] == [False, True, True]
    set_pdl(False)
    assert pdl_args(torch.device("cuda", 1)) == {"PDL": False, "launch_pdl": False}
    set_pdl(True)
    assert pdl_args(torch.device("cuda", 2)) == {"PDL": True, "launch_pdl": True}


def parse(line: str) -> tuple[str, dict[str, str]]:
    name, *facts = line.split(" | ")
    return name, dict(re.findall(r"(\w+)=(\w+)", " ".join(facts)))


def test_every_pdl_kernel_waits_before_any_store_and_reads_only_constants_before() -> None:
    """sm90 PTX and machine code of each PDL kernel at the launchers' defaults: launch_dependents
    first, one wait, no global store or atomic before it, global reads before it exactly in the
    kernels that prefetch constants; PDL off, no griddepcontrol at all; no PDL kernel left out."""
    *lines, uncovered = compiled_lines("tests.kernels.sm90_compile_pdl")
    assert uncovered == "not compiled here: none", uncovered
    stats = dict(parse(line) for line in lines)
    off = stats.pop("rms_norm pdl off")
    assert off["launch_dependents"] == off["wait"] == "0"
    assert len(stats) >= 20 and set(PREFETCH) <= set(stats)
    for name, s in stats.items():
        assert (s["launch_dependents"], s["wait"], s["launch_first"]) == ("1", "1", "True"), (name, s)
        assert s["stores_before_wait"] == s["sass_stores_before_wait"] == "0", (name, s)
        for key in ("reads_before_wait", "sass_reads_before_wait"):
            assert (int(s[key]) > 0) == (name in PREFETCH), (name, s)


class _EdgeData(ctypes.Structure):
    """CUgraphEdgeData (cuda.h, CUDA >= 12.3)."""

    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


def programmatic_edges(graph: torch.cuda.CUDAGraph) -> tuple[int, int]:
    """(programmatic edges, all edges) of a captured graph (`keep_graph=True`), by the driver's
    `cuGraphGetEdges_v2`."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    get_edges = getattr(libcuda, "cuGraphGetEdges_v2", None)
    if get_edges is None:
        pytest.skip("the driver has no cuGraphGetEdges_v2 (CUDA < 12.3): no programmatic edges to read")
    get_edges.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    assert get_edges(handle, None, None, None, ctypes.byref(n)) == 0
    nodes_from, nodes_to = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)()
    data = (_EdgeData * n.value)()
    assert get_edges(handle, nodes_from, nodes_to, data, ctypes.byref(n)) == 0
    return sum(d.type == CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC for d in data), n.value


def chain() -> Callable[[], torch.Tensor]:
    """RMSNorm → W4A16 GEMV (M = 1, split K) → RMSNorm + residual → rotary: four PDL launches in a
    row, the GEMV prefetching across its wait."""
    from kernels.rms_norm_triton import rms_norm_triton
    from kernels.rope_triton import rope_triton
    from kernels.w4a16_gemm import w4a16_gemm

    gen = torch.Generator().manual_seed(0)
    K, N, G = 2048, 1024, 32
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16).cuda()
    norm1 = (torch.rand(K, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    norm2 = (torch.rand(N, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    w = torch.randint(-(2**31), 2**31, (N, K // 8), generator=gen, dtype=torch.int64).to(torch.int32).cuda()
    s = (torch.rand(N, K // G, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    cos = torch.randn(1, 32, generator=gen).to(torch.bfloat16).cuda()
    sin = torch.randn(1, 32, generator=gen).to(torch.bfloat16).cuda()

    def run() -> torch.Tensor:
        h, _ = rms_norm_triton(x, norm1, 1e-6)
        y = w4a16_gemm(h, w, s, G)  # [1, N]
        z, _ = rms_norm_triton(y, norm2, 1e-6, residual=y)
        return rope_triton(z.view(1, N // 64, 64), cos, sin, 64, True)

    return run


@pytest.mark.gpu
def test_a_captured_graph_keeps_programmatic_edges_and_its_results(fresh_gate: None) -> None:
    if not pdl_args(torch.device("cuda"))["PDL"]:
        pytest.skip("PDL needs compute capability 9 or later")
    run = chain()
    out, edges = {}, {}
    for on in (False, True):
        set_pdl(on)
        eager = run()  # compiles this setting's variants outside the capture
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            captured = run()
        edges[on] = programmatic_edges(graph)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        out[on] = captured.clone()
    assert edges[False][0] == 0 and edges[False][1] >= 3
    assert edges[True][0] >= 3, edges  # norm → GEMV → norm → rotary, each a programmatic edge
    assert torch.equal(out[True], out[False])
