"""Triton kv_write against kv_write_ref: the same bytes in the cache and the same flags.

CPU CI runs the kernel under TRITON_INTERPRET=1; `gpu` tests run the real shapes (Kimi latent 576,
GLM-4.5-Air K 8 x 128, GLM-5 indexer keys 128) with bf16 values. Equality is exact (bytes), not a
tolerance: both sides divide with IEEE rounding, saturate, and convert round-to-nearest-even.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.kv_write import kv_write_ref  # noqa: E402
from kernels.kv_write_triton import kv_write_triton  # noqa: E402
from kernels.op_args import KvLines  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
FP8 = torch.float8_e4m3fn


def make_step(
    P: int,
    S: int,
    shape: tuple[int, ...],
    T: int,
    cache_dtype: torch.dtype,
    values_dtype: torch.dtype,
    seed: int,
) -> dict:
    """T tokens of 3 sequences on distinct random slots, some padding (-1), cache prefilled with
    random bytes (an unwritten slot must keep them), tags all matching."""
    g = torch.Generator().manual_seed(seed)
    cache = (torch.randn(P, S, *shape, generator=g) * 50).to(cache_dtype)
    values = (torch.randn(T, *shape, generator=g) * 3).to(values_dtype)
    slots = torch.randperm(P * S, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[: T // 5]] = -1
    page_tags = torch.randint(0, 2**40, (P,), generator=g)
    token_seq = torch.randint(0, 3, (T,), generator=g)
    expected = torch.where(slots >= 0, page_tags[slots.clamp(min=0) // S], 12345)
    return dict(
        cache=cache, values=values, slot_mapping=slots, scale=1.0, page_tags=page_tags,
        token_expected_tags=expected, token_seq=token_seq, tag_mismatch=torch.zeros(3, dtype=torch.bool),
    )  # fmt: skip


def run_both(step: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ref = {**step, "cache": step["cache"].clone(), "tag_mismatch": step["tag_mismatch"].clone()}
    kv_write_ref(**ref)
    dev = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in step.items()}
    kv_write_triton(**dev)
    return dev["cache"].cpu(), ref["cache"], dev["tag_mismatch"].cpu(), ref["tag_mismatch"]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize(
    ("shape", "cache_dtype", "values_dtype"),
    [
        ((576,), torch.float32, torch.float32),  # MLA latent, wider than one block of 512
        ((3, 40), torch.float16, torch.float32),  # GQA-like K, rounded fp32 -> fp16
        ((24,), torch.float16, torch.float16),  # indexer keys
        ((5, 7), torch.bfloat16, torch.bfloat16),
        # fp32 -> bf16: the interpreter truncates where the GPU rounds to nearest even, so GPU only
        pytest.param((5, 7), torch.bfloat16, torch.float32, marks=pytest.mark.gpu),
    ],
)
def test_matches_reference(
    shape: tuple[int, ...], cache_dtype: torch.dtype, values_dtype: torch.dtype
) -> None:
    step = make_step(P=6, S=5, shape=shape, T=23, cache_dtype=cache_dtype, values_dtype=values_dtype, seed=1)
    out, ref, flags, ref_flags = run_both(step)
    assert same_bytes(out, ref)
    assert not flags.any() and not ref_flags.any()
    assert not same_bytes(out, step["cache"])  # something was written


def test_large_line_spans_several_programs() -> None:
    """A 1100-value line (GQA 8 x 128 plus change) is written by two programs per token."""
    step = make_step(
        P=3, S=4, shape=(1100,), T=7, cache_dtype=torch.float32, values_dtype=torch.float32, seed=2
    )
    out, ref, _, _ = run_both(step)
    assert same_bytes(out, ref)


@pytest.mark.parametrize("values_dtype", [torch.float32, torch.float16])
def test_fp8_bytes_equal_reference_and_saturate(values_dtype: torch.dtype) -> None:
    """The interpreter's float -> e4m3 emulation does not carry a rounded-up mantissa into the
    exponent (126.05 becomes 64, where the GPU's cvt.rn.satfinite gives 128), so on the CPU the
    values are e4m3 numbers times a power-of-two scale: the division and conversion are exact and
    the test checks the scale, the saturation and the scatter byte for byte. Rounding of arbitrary
    values is checked byte for byte on the GPU (test_gpu_real_shapes)."""
    step = make_step(P=5, S=8, shape=(40,), T=30, cache_dtype=FP8, values_dtype=values_dtype, seed=3)
    scale = 2.0**-6
    if DEV == "cpu":
        step["values"] = (step["values"].float() * 40).to(FP8).float().mul(scale).to(values_dtype)
    else:
        scale = 0.0123
    step["scale"] = scale
    step["values"][0, :4] = torch.tensor([1e4 * scale, -1e4 * scale, 480 * scale, 0.0])  # beyond ±448
    step["slot_mapping"][0] = 7  # make sure row 0 is written
    step["token_expected_tags"][0] = step["page_tags"][0]
    out, ref, _, _ = run_both(step)
    assert same_bytes(out, ref)
    assert out[0, 7, :3].float().tolist() == [448.0, -448.0, 448.0]
    written = step["slot_mapping"] >= 0
    assert (
        int((out.view(-1, 40)[step["slot_mapping"][written]].float().abs() > 100).sum()) > 10
    )  # not all small


def test_wrong_tag_skips_the_write_and_flags_only_that_sequence() -> None:
    step = make_step(
        P=6, S=4, shape=(9,), T=12, cache_dtype=torch.float32, values_dtype=torch.float32, seed=4
    )
    rest = step["slot_mapping"][3:]
    step["slot_mapping"][3:] = torch.where((rest == 5) | (rest == 9), -1, rest)  # slots 5 and 9: ours only
    step["slot_mapping"][:3] = torch.tensor([5, 9, -1])
    step["token_seq"][:3] = torch.tensor([2, 2, 1])
    step["token_expected_tags"][0] = step["page_tags"][1] + 1  # page 1 was reallocated since
    step["token_expected_tags"][1] = step["page_tags"][2]
    step["token_expected_tags"][2] = -7  # padding: never checked, never flags
    step["token_seq"][3:] = torch.where(step["token_seq"][3:] == 2, 0, step["token_seq"][3:])
    before = step["cache"].clone()
    out, ref, flags, ref_flags = run_both(step)
    assert flags.tolist() == [False, False, True] == ref_flags.tolist()
    assert torch.equal(out[1, 1], before[1, 1])  # slot 5 kept its old bytes
    assert torch.equal(out[2, 1], step["values"][1])  # slot 9 was written
    assert same_bytes(out, ref)


def test_check_off_writes_every_live_slot_and_flags_nothing() -> None:
    """`token_expected_tags` None (the engine's check off): the tags are neither compared nor
    loaded (every expected tag and every page tag is wrong here), the bytes equal the reference's
    and the checked write's on right tags."""
    step = make_step(
        P=6, S=4, shape=(9,), T=12, cache_dtype=torch.float32, values_dtype=torch.float32, seed=8
    )
    checked, _, _, _ = run_both(step)
    off = {**step, "page_tags": step["page_tags"] + 1, "token_expected_tags": None}
    out, ref, flags, ref_flags = run_both(off)
    assert same_bytes(out, checked) and same_bytes(ref, checked)
    assert not flags.any() and not ref_flags.any()
    assert not same_bytes(out, step["cache"])


def test_slot_past_the_pool_is_flagged_not_written() -> None:
    """The reference raises on such a slot; the kernel flags the sequence and never writes out of
    bounds (the pool is a view of a larger buffer here, so a stray write would show in page 4)."""
    step = make_step(P=4, S=4, shape=(8,), T=6, cache_dtype=torch.float32, values_dtype=torch.float32, seed=7)
    step["slot_mapping"][2] = 4 * 4 + 1
    step["slot_mapping"][3:] = torch.where(step["slot_mapping"][3:] == 1, -1, step["slot_mapping"][3:])
    step["token_expected_tags"][2] = step["page_tags"][0]  # what page 0 carries: must not matter
    step["token_seq"][:] = torch.tensor([0, 0, 2, 0, 0, 0])
    with pytest.raises(IndexError):
        kv_write_ref(**{**step, "cache": step["cache"].clone(), "tag_mismatch": step["tag_mismatch"].clone()})
    buffer = torch.zeros(5, 4, 8, device=DEV)
    buffer[:4] = step["cache"].to(DEV)
    dev = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in step.items()}
    kv_write_triton(**{**dev, "cache": buffer[:4]})
    assert dev["tag_mismatch"].cpu().tolist() == [False, False, True]
    assert torch.equal(buffer[4].cpu(), torch.zeros(4, 8))
    assert torch.equal(buffer[0, 1].cpu(), step["cache"][0, 1])  # nor wrapped onto page 0


def test_non_contiguous_values_and_empty_step() -> None:
    step = make_step(
        P=4, S=4, shape=(2, 6), T=9, cache_dtype=torch.float16, values_dtype=torch.float32, seed=5
    )
    step["values"] = torch.randn(9, 6, 2).transpose(1, 2)  # [T, 2, 6] with the last dims transposed
    out, ref, _, _ = run_both(step)
    assert same_bytes(out, ref)
    empty = {**step, "values": step["values"][:0], "slot_mapping": step["slot_mapping"][:0]}
    empty |= {"token_expected_tags": step["token_expected_tags"][:0], "token_seq": step["token_seq"][:0]}
    kv_write_triton(**empty)


@pytest.mark.parametrize("check_tags", [True, False])
@pytest.mark.parametrize(("second_dtype", "block"), [(torch.float16, 1), (FP8, 2.0**-4)])
def test_second_cache_in_the_same_launch(check_tags: bool, second_dtype: torch.dtype, block: float) -> None:
    """A DSA layer's two lines at shrunken shapes: a latent of 40 (fp32) and indexer keys of 24 (fp16, or
    FP8 at its own scale: e4m3 numbers times a power of two, exact in the interpreter) written by one
    launch at the same slots. Both caches' bytes and the flags equal the reference's (which writes
    them one after the other) and two single-cache launches': three misrouted tokens write neither
    line and flag their sequences once."""
    step = make_step(
        P=6, S=4, shape=(40,), T=14, cache_dtype=torch.float32, values_dtype=torch.float32, seed=9
    )
    g = torch.Generator().manual_seed(10)
    cache2 = (torch.randn(6, 4, 24, generator=g) * 20).to(second_dtype)
    values2 = (torch.randn(14, 24, generator=g) * 30).to(FP8).float().mul(block).half()
    live = (step["slot_mapping"] >= 0).nonzero().flatten()[:3]
    step["token_expected_tags"][live] += 1  # three misrouted writes
    if not check_tags:
        step["token_expected_tags"] = None
    ref = {**step, "cache": step["cache"].clone(), "tag_mismatch": step["tag_mismatch"].clone()}
    ref_second = KvLines(cache2.clone(), values2, block)
    kv_write_ref(**ref, second=ref_second)
    dev = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in step.items()}
    dev_second = KvLines(cache2.to(DEV, copy=True), values2.to(DEV), block)
    kv_write_triton(**dev, second=dev_second)
    assert same_bytes(dev["cache"].cpu(), ref["cache"]) and same_bytes(
        dev_second.cache.cpu(), ref_second.cache
    )
    assert torch.equal(dev["tag_mismatch"].cpu(), ref["tag_mismatch"])
    assert bool(ref["tag_mismatch"].any()) == check_tags
    one = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in step.items()}
    kv_write_triton(**one)
    kv_write_triton(**{**one, "cache": cache2.to(DEV, copy=True), "values": values2.to(DEV), "scale": block})
    assert same_bytes(one["cache"].cpu(), ref["cache"]) and torch.equal(
        one["tag_mismatch"].cpu(), ref["tag_mismatch"]
    )
    assert not same_bytes(ref_second.cache, cache2)  # something was written


def test_launcher_rejects_bad_inputs() -> None:
    step = make_step(P=4, S=4, shape=(8,), T=5, cache_dtype=torch.float32, values_dtype=torch.float32, seed=6)
    with pytest.raises(ValueError):
        kv_write_triton(**{**step, "values": step["values"][:, :7]})
    with pytest.raises(ValueError):
        kv_write_triton(**{**step, "slot_mapping": step["slot_mapping"].int()})
    with pytest.raises(ValueError):
        kv_write_triton(**{**step, "cache": torch.zeros(4, 8, 4).transpose(1, 2)})  # per-token dim strided
    with pytest.raises(TypeError):
        kv_write_triton(**{**step, "values": step["values"].to(torch.int32)})
    tags = step["page_tags"]
    with pytest.raises(ValueError):  # a strided tag vector: the kernel indexes it by page id, no stride
        kv_write_triton(**{**step, "page_tags": torch.stack([tags, tags], dim=1)[:, 0]})
    with pytest.raises(ValueError):
        kv_write_triton(**{**step, "page_tags": tags.int()})
    with pytest.raises(ValueError, match="second cache"):  # another pool's pages
        kv_write_triton(**step, second=KvLines(torch.zeros(5, 4, 3), torch.zeros(5, 3), 1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("shape", [(576,), (8, 128), (128,)])
def test_gpu_real_shapes(shape: tuple[int, ...], cache_dtype: torch.dtype) -> None:
    """bf16 values (a decode step of 64 and a prefill chunk of 4096 tokens) on a 4096-page pool."""
    for T in (64, 4096):
        step = make_step(
            P=4096, S=16, shape=shape, T=T, cache_dtype=cache_dtype, values_dtype=torch.bfloat16, seed=T
        )
        step["scale"] = 0.02 if cache_dtype == FP8 else 1.0
        step["token_expected_tags"][:3] += 1  # three misrouted writes
        out, ref, flags, ref_flags = run_both(step)
        assert same_bytes(out, ref) and torch.equal(flags, ref_flags)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gpu_dsa_layer_lines_in_one_launch(cache_dtype: torch.dtype) -> None:
    """A GLM-5 layer's latent (576) and indexer keys (128), bf16 values, in one launch on a 4096-page
    pool: the bytes and flags of the reference's two writes."""
    for T in (1, 64):
        step = make_step(
            P=4096, S=64, shape=(576,), T=T, cache_dtype=cache_dtype, values_dtype=torch.bfloat16, seed=T
        )
        step["scale"] = 0.02 if cache_dtype == FP8 else 1.0
        step["token_expected_tags"][: T // 8] += 1
        g = torch.Generator().manual_seed(T + 1)
        cache2 = (torch.randn(4096, 64, 128, generator=g) * 5).to(cache_dtype)
        values2 = torch.randn(T, 128, generator=g).bfloat16()
        ref = {**step, "cache": step["cache"].clone(), "tag_mismatch": step["tag_mismatch"].clone()}
        ref_second = KvLines(cache2.clone(), values2, 0.01)
        kv_write_ref(**ref, second=ref_second)
        dev = {k: (v.to(DEV, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in step.items()}
        dev_second = KvLines(cache2.to(DEV), values2.to(DEV), 0.01)
        kv_write_triton(**dev, second=dev_second)
        assert same_bytes(dev["cache"].cpu(), ref["cache"]) and same_bytes(
            dev_second.cache.cpu(), ref_second.cache
        )
        assert torch.equal(dev["tag_mismatch"].cpu(), ref["tag_mismatch"])
