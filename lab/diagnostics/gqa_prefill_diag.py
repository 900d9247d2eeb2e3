"""GPU diagnosis of the GQA prefill kernel (2026-12-02): per-sequence and even/odd-column errors of every
PREFILL_TILES entry, SPLIT_V on and off, one and two splits, on a clean batch, a bumped tag and a NaN page; each
case in its own process with CUDA_LAUNCH_BLOCKING=1 (an illegal address kills the context). Log:
`lab/results/2026-12-02-gqa-prefill-splitv-diag.log`. Usage (device): `python3 lab/diagnostics/gqa_prefill_diag.py`."""

import dataclasses
import json
import subprocess
import sys

import torch


def one(name, splits, case, split_v, D=32):
    from kernels.paged_attention import paged_attention_ref
    from kernels.paged_prefill_gqa import PREFILL_TILES, paged_prefill_gqa
    from tests.kernels.test_paged_prefill_gqa import FP8, make_batch

    tiles = PREFILL_TILES[name]
    if split_v is not None:
        tiles = dataclasses.replace(tiles, split_v=split_v)
    kv = FP8 if name.startswith("fp8") else torch.float16
    batch, paged = make_batch([90, 107, 300], [90, 7, 1], 12, 1, D, 16, kv, torch.float16, seed=8)
    bad = paged.pages[0][3]
    if case != "clean":
        batch["page_tags"][bad] += 1
    if case == "nan":
        for c in ("k_cache", "v_cache"):
            batch[c][bad] = torch.tensor(float("nan")).to(kv)
    ref_in = {**batch, "tag_mismatch": batch["tag_mismatch"].clone()}
    ref = paged_attention_ref(**ref_in)
    dev = {k: (v.to("cuda", copy=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    out = torch.full(ref.shape, float("nan"), dtype=ref.dtype, device="cuda")
    paged_prefill_gqa(**dev, out=out, tiles=tiles, num_splits=splits)
    torch.cuda.synchronize()
    o = out.cpu().double()
    r = ref.double()

    def e(a, b):
        return float((a - b).norm() / b.norm())

    segs = {"s0[:48]": slice(0, 48), "s0[48:]": slice(48, 90), "s1": slice(90, 97), "s2": slice(97, 98)}
    res = {k: round(e(o[s], r[s]), 4) for k, s in segs.items()}
    res["even"] = round(e(o[..., 0::2], r[..., 0::2]), 4)
    res["odd"] = round(e(o[..., 1::2], r[..., 1::2]), 4)
    res["nan"] = int(o.isnan().sum())
    res["flags"] = dev["tag_mismatch"].cpu().tolist()
    from kernels.gqa_slice import slice_constexprs  # whether the launch really read V as byte pairs

    res["SPLIT_V"] = slice_constexprs(tiles, dev["q"], dev["k_cache"], dev["v_cache"], D, D)["SPLIT_V"]
    return res


if __name__ == "__main__":
    if len(sys.argv) > 1:
        a = json.loads(sys.argv[1])
        print(json.dumps(one(**a)))
        sys.exit(0)
    import os
    from concurrent.futures import ThreadPoolExecutor

    from kernels.paged_prefill_gqa import PREFILL_TILES

    jobs = [
        dict(name=n, splits=sp, case=c, split_v=sv, D=D)
        for D in (
            64,
            128,
        )  # SPLIT_V is off below Dv 128 since the second 2026-12-02 run (slice_constexprs); on at 128
        for n in sorted(PREFILL_TILES)
        for sv in ([None, False] if n.startswith("fp8") else [None])
        for sp in (1, 2)
        for c in ("clean", "nan")
    ]

    def run(a):
        p = subprocess.run(
            [sys.executable, __file__, json.dumps(a)],
            capture_output=True,
            text=True,
            timeout=170,
            env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"},
        )
        tail = (
            p.stdout.strip().splitlines()[-1:]
            if p.returncode == 0
            else [l for l in p.stderr.splitlines() if "Error" in l][-1:]
        )
        return f"D={a['D']} {a['name']:12s} {'split_v' if a['split_v'] is None else 'no-splitv'} splits={a['splits']} {a['case']:5s} rc={p.returncode} {' '.join(tail)}"

    with ThreadPoolExecutor(12) as ex:
        for line in ex.map(run, jobs):
            print(line, flush=True)
