"""GPU-only checks from the 2026-12-01 review of the CPU-verified rewrites. Run from the
repo root on the device: `timeout 120 python3 -m lab.diagnostics.gpu_review_checks` (CHECKS=a,c to pick).
CPU smoke test of the script itself: `SMALL=1 DEV=cpu TRITON_INTERPRET=1 python -m ...` (fp16 there).

Each check prints its result lines and its seconds as soon as it ends (a timeout keeps the finished
ones), then all of them again at the end. Their time is Triton compiles (a new one for every
constexpr set and every integer argument that is or is not 1 or a multiple of 16), not the GPU: a
26-60 s, b 13-26 s, c 2-3 s in the H200 logs of 2026-12-01 and 2026-12-02 (beside trainings, then
beside pytest workers compiling; alone, expect the lower figures). The loops
of a (its REPS runs) and d (its cases) stop at BUDGET_S (default 40) seconds of their check and say
how far they got. d once took 96 cases of a one-program kernel with a 1024-wide `tl.sort`: 56
compiles, ~1-2 s each, so it never printed inside `timeout 120` (2026-12-01, 2026-12-02 run 3); it
now takes 12 cases of 12 compiles that cover what those did (see D_CASES).

a  GQA re-walk race (gqa_slice.py; fixed by a barrier and a volatile read-back, this checks the fix): a bad
   page in slice >= 1, where `restart = start * flag` is read back by every thread right after thread 0
   stored it; REPS runs, counts runs that differ bitwise from run 0 or from the reference. A hang shows
   as the timeout.
b  INT4 denormal-nibble GEMVs (W4A16 M=1/2 raw and lifted, MoE GEMV): every nibble value, activations over
   2^-40..2^40, zeros and a zero row; against fp64.
c  split-K counters: zero after eager calls and after 3 CUDA-graph replays; replays bit-identical to eager.
d  moe_align vs moe_align_ref bit for bit: P 1..32768, E 8/31/128/384, BM 16/64, ids outside [0, E).
"""

from __future__ import annotations

import os
import time

import torch

DEV = os.environ.get("DEV", "cuda")
SMALL = os.environ.get("SMALL") == "1"
ACT = torch.float16 if SMALL else torch.bfloat16  # bf16 tl.dot is wrong in the interpreter
REPS = 2 if SMALL else 200
BUDGET_S = float(os.environ.get("BUDGET_S", "40"))  # a check's loop stops past this many seconds
# check d's (E, P, BM): each a distinct specialisation, so one compile each. Kimi's 384 experts for
# decode (8 pairs), a batch of 64 tokens, one pair, a chunk and one more, 8 ragged chunks and 32 full
# ones; 128 / 31 / 8 experts at a tail under one chunk and at one chunk or more; BM 16 and 64 each.
D_CASES = [
    (384, 8, 16), (384, 512, 16), (384, 1, 64), (384, 1025, 16), (384, 32768, 16), (384, 8191, 64),
    (128, 17, 16), (128, 4096, 64), (31, 100, 16), (31, 1023, 64), (8, 7, 16), (8, 32768, 64),
]  # fmt: skip
D_SMALL = [(8, 1, 16), (8, 100, 64), (31, 17, 16), (31, 8, 64)]
res: list[tuple[str, bool, str]] = []
deadline = 0.0  # time.time() past which the running check's loops stop (main sets it per check)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def check_a() -> None:
    from kernels.paged_decode_gqa import paged_decode_gqa
    from kernels.paged_prefill_gqa import paged_prefill_gqa
    from tests.kernels.paged_layout import query_starts, random_pages
    from tests.kernels.test_paged_decode_gqa import make_batch, paged_decode_gqa_ref, to

    L, Hq, Hkv, D = (200, 4, 2, 32) if SMALL else (2000, 96, 8, 128)
    for kv in (ACT, torch.float8_e4m3fn):
        batch = make_batch([L] * 4, Hq, Hkv, D, 16, kv, ACT, torch.Generator().manual_seed(1))
        col = (L * 6 // 10) // 16  # ~60% in: slice 2 of 4 (start > 0)
        bad = int(batch["page_table"][3, col])
        batch["page_tags"][bad] += 1
        batch["k_cache"][bad] = batch["v_cache"][bad] = torch.tensor(float("nan")).to(kv)
        ref = paged_decode_gqa_ref(**{**batch, "tag_mismatch": batch["tag_mismatch"].clone()}).float()
        dev = to(batch, DEV)
        first, diff, off, t0, reps = None, 0, 0, time.time(), 0
        while reps < REPS and (reps < 2 or time.time() < deadline):
            reps += 1
            dev["tag_mismatch"].zero_()
            out = paged_decode_gqa(**dev, num_splits=4).float()
            first = out.clone() if first is None else first
            diff += int(not torch.equal(out, first))
            off += int(not (bool(out.isfinite().all()) and rel(out.cpu(), ref) < 3e-2))
        sync()
        flag = dev["tag_mismatch"].cpu().tolist() == [False, False, False, True]
        res.append(
            (
                f"a gqa decode re-walk {kv}",
                diff == 0 and off == 0 and flag,
                f"differ from run 0: {diff}/{reps}, off ref: {off}/{reps}, flags ok {flag}, {time.time() - t0:.1f}s",
            )
        )
    g = torch.Generator(device=DEV).manual_seed(0)
    T, NQ = (200, 16) if SMALL else (4096, 64)
    table, tags = random_pages([T], 16, g)
    P = tags.shape[0]
    k = torch.randn(P, 16, Hkv, D, device=DEV, generator=g).to(ACT)
    v = torch.randn(P, 16, Hkv, D, device=DEV, generator=g).to(ACT)
    batch = dict(
        q=torch.randn(NQ, Hq, D, device=DEV, generator=g).to(ACT), k_cache=k, v_cache=v, k_scale=1.0,
        v_scale=1.0, query_start=query_starts([NQ]).to(DEV),
        seq_lens=torch.tensor([T], dtype=torch.int32, device=DEV), page_table=table,
        expected_tags=tags[table.long()], page_tags=tags.clone(),
        tag_mismatch=torch.zeros(1, dtype=torch.bool, device=DEV), softmax_scale=D**-0.5,
    )  # fmt: skip
    batch["page_tags"][int(table[0, (T * 6 // 10) // 16])] += 1
    first, diff, reps = None, 0, 0
    while reps < REPS // 2 and (reps < 2 or time.time() < deadline):
        reps += 1
        batch["tag_mismatch"].zero_()
        out = paged_prefill_gqa(**batch, num_splits=4).float()
        first = out.clone() if first is None else first
        diff += int(not torch.equal(out, first))
    sync()
    res.append(("a gqa prefill re-walk", diff == 0, f"differ from run 0: {diff}/{reps}"))


def int4_words(N: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """[N, K/8] int32 checkpoint words, every nibble value 0..15 (q + 8), top nibble >= 8 included."""
    q = torch.randint(0, 16, (N, K // 8, 8), generator=gen, dtype=torch.int64)
    words = (q << torch.arange(0, 32, 4)).sum(-1)  # < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def check_b() -> None:
    from kernels.formats.int4 import unpack
    from kernels.fused_moe import MoEConfig, fused_moe, fused_moe_ref
    from kernels.w4a16_config import W4A16Config, with_split_k
    from kernels.w4a16_gemm import w4a16_gemm

    gen = torch.Generator().manual_seed(3)
    N, K = (64, 512) if SMALL else (4096, 7168)
    w = int4_words(N, K, gen)
    q = unpack(w).double()  # [N, K] in -8..7
    for group in (32, 128):
        s = (torch.rand(N, K // group, generator=gen) * 0.02 + 0.002).to(torch.bfloat16)
        wd = q * s.double().repeat_interleave(group, 1)
        base = torch.randn(2, K, generator=gen)
        rows = {  # per-row ranges: mixed 2^-40..2^40, half zeros, all tiny, all huge (|x| < 2^51 is the limit)
            "mixed": base[0] * 2.0 ** torch.randint(-40, 41, (K,), generator=gen).float(),
            "halfzero": torch.cat([torch.zeros(K // 2), base[1, K // 2 :]]),
            "tiny": base[0] * 2.0**-40, "huge": base[1] * 2.0**44,
        }  # fmt: skip
        xdt = torch.float32 if SMALL else torch.bfloat16
        for name, pair in (("mixed", ("mixed",)), ("halfzero", ("halfzero",)), ("tiny", ("tiny",)),
                           ("huge", ("huge",)), ("M2", ("mixed", "tiny"))):  # fmt: skip
            x = torch.stack([rows[r] for r in pair]).to(xdt)
            for lift in (False, True):
                cfg = with_split_k(W4A16Config(block_m=0, block_n=64 if SMALL else 128, block_k=256, lift=lift),
                                   len(pair), N, K, 4 if SMALL else 132)  # fmt: skip
                out = w4a16_gemm(x.to(DEV), w.to(DEV), s.to(DEV), group, config=cfg).double().cpu()
                want = x.double() @ wd.t()
                e = max(rel(o, t) for o, t in zip(out, want, strict=True))  # per row: tiny rows count too
                res.append(
                    (
                        f"b w4a16 gemv g{group} {name} lift={lift}",
                        e < 1e-2 and bool(out.isfinite().all()),
                        f"rel {e:.2e}, split {cfg.split_k}",
                    )
                )
        z = w4a16_gemm(torch.zeros(1, K, dtype=ACT, device=DEV), w.to(DEV), s.to(DEV), group)
        res.append(
            (f"b w4a16 zero row g{group}", bool((z == 0).all()), f"max |out| {float(z.abs().max()):.1e}")
        )
    E, H, I = (4, 256, 128) if SMALL else (16, 2048, 512)
    w13 = torch.stack([int4_words(2 * I, H, gen) for _ in range(E)])
    w2 = torch.stack([int4_words(H, I, gen) for _ in range(E)])
    s13 = (torch.rand(E, 2 * I, H // 32, generator=gen) * 0.02 + 0.002).to(torch.bfloat16)
    s2 = (torch.rand(E, H, I // 32, generator=gen) * 0.02 + 0.002).to(torch.bfloat16)
    x = torch.randn(2, H, generator=gen).to(ACT)
    ids = torch.tensor([[0, 3, 1, 99], [3, 2, -1, E - 1]])  # 99 / -1: another rank's experts
    wts = torch.rand(2, 4, generator=gen)
    ref = fused_moe_ref(x, ids, wts, w13, s13, w2, s2, 32).float()
    for lift, split in ((True, 0), (False, 0), (True, 4)):
        cfg = MoEConfig(block_m=0, block_n=64, block_k=128, lift=lift, split_k=split)
        out = fused_moe(*(t.to(DEV) for t in (x, ids, wts, w13, s13, w2, s2)), 32, config=cfg).float().cpu()
        res.append(
            (
                f"b moe gemv lift={lift} split={split}",
                rel(out, ref) < 2e-2 and float(ref.norm()) > 0,
                f"rel {rel(out, ref):.2e}, |ref| {float(ref.norm()):.2e}",
            )
        )


def check_c() -> None:
    from kernels.split_k_merge import split_k_counters
    from kernels.w4a16_gemm import w4a16_gemm

    gen = torch.Generator().manual_seed(5)
    N, K = 8192, 8192
    w = int4_words(N, K, gen).to(DEV)
    s = (torch.rand(N, K // 128, generator=gen) * 0.02 + 0.002).to(torch.bfloat16).to(DEV)
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16).to(DEV)
    a = w4a16_gemm(x, w, s, 128)
    torch.cuda.synchronize()
    nz_eager = int(split_k_counters(x.device, 1).count_nonzero())
    out = torch.empty_like(a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        w4a16_gemm(x, w, s, 128, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w4a16_gemm(x, w, s, 128, out=out)
    same = True
    for _ in range(3):
        graph.replay()
        same &= torch.equal(out, a)
    torch.cuda.synchronize()
    nz = int(split_k_counters(x.device, 1).count_nonzero())
    res.append(
        (
            "c split-K counters, graph replays",
            same and nz == 0 and nz_eager == 0,
            f"nonzero counters: eager {nz_eager}, after replays {nz}; replays == eager: {same}",
        )
    )


def check_d() -> None:
    from kernels.moe_align import moe_align, moe_align_ref

    gen = torch.Generator().manual_seed(9)
    fails, cases = [], D_SMALL if SMALL else D_CASES
    done = 0
    for E, P, bm in cases:
        if time.time() > deadline:
            break
        ids = torch.randint(-2, E + 3, (P, 1), generator=gen)
        got = moe_align(ids.to(DEV), E, bm)
        want = moe_align_ref(ids, E, bm)
        if not all(torch.equal(a.cpu(), b.to(torch.int32)) for a, b in zip(got, want, strict=True)):
            fails.append(f"E{E} P{P} bm{bm}")
        done += 1
    cut = f" (cut at {BUDGET_S:.0f}s)" if done < len(cases) else ""
    res.append(
        (
            "d moe_align == ref",
            not fails,
            f"{done}/{len(cases)} cases{cut}, {len(fails)} failing: {fails[:6]}",
        )
    )


def line(n: str, ok: bool, d: str) -> str:
    return f"{n:<44} {'ok' if ok else 'FAIL':<5} {d}"


def main() -> None:
    global deadline
    t_all = time.time()
    for name in os.environ.get("CHECKS", "a,b,c,d").split(","):
        t, first = time.time(), len(res)
        deadline = t + BUDGET_S
        try:
            globals()[f"check_{name}"]()
        except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others
            res.append((f"{name} raised", False, f"{type(exc).__name__}: {str(exc)[:300]}"))
        for r in res[first:]:  # now, not only at the end: a timeout keeps the finished checks
            print(line(*r), flush=True)
        print(f"check {name}: {time.time() - t:.1f}s", flush=True)
    print(f"all checks: {time.time() - t_all:.1f}s, {sum(not ok for _, ok, _ in res)} failing")
    print(f"{'check':<44} {'ok':<5} detail")
    for r in res:
        print(line(*r))


if __name__ == "__main__":
    main()
