"""Kumo kernels: one public entry per op, each taking a frozen argument struct and picking the Triton
kernels on CUDA and the torch reference elsewhere (triton is the optional `gpu` extra, so an entry
imports its Triton file only on the CUDA branch).

Naming rule: `<op>.py` holds the op's argument struct, its torch reference `<op>_ref` and the public
entry `<op>(args)`; its Triton kernels (`_<name>_kernel`) and launchers, which check shapes, strides
and dtypes, live beside it in the files its docstring names (`<op>_triton.py`, or one file per phase
where the op has a decode and a prefill kernel).

| entry (struct)                               | reference + entry    | Triton                                      |
|----------------------------------------------|----------------------|---------------------------------------------|
| `mla_attention` (`MlaAttentionArgs`)         | `mla_attention.py`   | `mla_decode.py`, `mla_prefill.py`, `mla_tiles.py` |
| `paged_attention` (`PagedAttentionArgs`)     | `paged_attention.py` | `paged_decode_gqa.py`, `paged_prefill_gqa.py`, `gqa_slice.py` |
| `dsa_indexer` (`DsaIndexerArgs`)             | `dsa_indexer.py`     | `dsa_indexer_triton.py`                     |
| `kv_write` (`KvWriteArgs`)                   | `kv_write.py`        | `kv_write_triton.py`                        |
| `int4_linear` (`Int4LinearArgs`)             | `int4_linear.py`     | `w4a16_gemm.py` (tiles, dequant + cuBLAS), `w4a16_gemv.py`, `w4a16_config.py` |
| `fp8_linear` (`Fp8LinearArgs`)               | `fp8_linear.py`      | `fp8_gemm.py` (weight-only GEMV and tiles, M ≤ 64) |
| `act_mul` (`ActMulArgs`)                     | `act_mul.py`         | `act_mul_triton.py` (SiLU, routed or not)   |
| `row_norms` (`RowNormsArgs`)                 | `row_norms.py`       | `row_norms_triton.py` (up to 3 norms)       |
| `draft_rows` (`DraftRowsArgs`)               | `draft_rows.py`      | `draft_rows_triton.py` (chained drafts' rows) |
| `verify_accept` (`VerifyAcceptArgs`)         | `verify_accept.py`   | `verify_accept_triton.py` (a greedy verify's tail) |

GPU-only ops (kernel, launcher and reference in one file; `backend/quant` calls them on CUDA and
keeps its own torch path elsewhere): `w4a8_gemm.py`, `w4a8_expand.py`,
`int4_dequant.py`, `fused_moe.py` (INT4) and `fused_moe_fp8.py` on `moe_routing.py`'s driver and
`moe_align.py`, `split_k_merge.py` (the split-K attention merge and the launchers' device facts).

Shared, not ops: `triton_lib.py` (every `@triton.jit` function more than one op uses; ops never
import each other's private names; the Programmatic Dependent Launch rules and switch every decode
kernel's launcher follows), `paged_gather.py` (the page-tag check and gather every reference
reads through, and `PagedBatch`, the step's pages as every page-reading op's struct carries them),
and `formats/` (the INT4 and FP8 weight formats, shared with `backend/quant`).
"""
