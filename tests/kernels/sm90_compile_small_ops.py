"""Compile issue 24's small decode ops (RMSNorm, the LoRA row norms, SiLU · up, rotary, the MoE gate's GEMV and routing, DSA selection,
the greedy verify's tail) for sm90
(H200) without a GPU, at GLM-5's shapes; prints ptxas's registers and spills per kernel. Run
without TRITON_INTERPRET (the interpreter never lowers a kernel):

    python -m tests.kernels.sm90_compile_small_ops
"""

from __future__ import annotations

from triton.compiler import ASTSource

from tests.kernels.sm90_compile import _source, compile_sm90


def builds() -> list[tuple[str, ASTSource, int]]:
    from kernels.act_mul_triton import _silu_mul_kernel
    from kernels.rms_norm_triton import _rms_norm_kernel
    from kernels.rope_triton import _rope_kernel
    from kernels.router_logits_triton import _router_logits_kernel
    from kernels.router_triton import _route_kernel
    from kernels.row_norms_triton import _row_norms_kernel
    from kernels.selection_triton import _radix_resident_kernel, _radix_select_kernel, _selection_keys_kernel
    from kernels.verify_accept_triton import _accept_kernel, _row_argmax_kernel

    bf16 = {"x_ptr": "bf16", "r_ptr": "bf16", "w_ptr": "bf16", "out_ptr": "bf16", "h_ptr": "bf16"}
    rope = {
        "cos_ptr": "bf16",
        "sin_ptr": "bf16",
        **{f"{p}{i}_ptr": "bf16" for p in ("x", "out") for i in range(4)},
    }
    norms = {f"{p}{i}_ptr": "bf16" for p in ("x", "w", "b", "out") for i in range(3)}
    norms |= {f"rows{i}_ptr": "i64" for i in range(3)}
    lora = {
        "NUM": 3,
        "BLOCK_D0": 2048,
        "BLOCK_D1": 512,
        "BLOCK_D2": 128,
        "LAYER0": False,
        "LAYER1": False,
        "LAYER2": True,
        "GATHER0": False,
        "GATHER1": False,
        "GATHER2": False,
    }
    mtp_in = {**lora, "NUM": 2, "BLOCK_D0": 8192, "BLOCK_D1": 8192, "LAYER2": False, "GATHER0": True}
    route = {"logits_ptr": "fp32", "bias_ptr": "fp32", "weights_ptr": "fp32", "ids_ptr": "i64"}
    radix = {"scores_ptr": "fp32", "out_ptr": "i64"}
    silu = {"g_ptr": "bf16", "u_ptr": "bf16", "out_ptr": "bf16", "ids_ptr": "i64", "w_ptr": "fp32"}
    gate = {"x_ptr": "bf16", "w_ptr": "fp32", "out_ptr": "fp32"}
    argmax = {"logits_ptr": "fp32", "guards_ptr": "i64", "val_ptr": "fp32", "idx_ptr": "i64"}
    accept = {
        "val_ptr": "fp32", "idx_ptr": "i64", "ids_ptr": "i64", "query_start_ptr": "i32",
        "targets_ptr": "i64", "accepted_ptr": "i64", "last_ptr": "i64",
    }  # fmt: skip
    return [
        ("rms_norm hidden 6144 + residual", _source(_rms_norm_kernel, bf16, {"HAS_RESIDUAL": True, "BLOCK_D": 8192}, {"eps"}), 16),
        ("row_norms q_a 2048 + kv_a 512 + indexer key 128", _source(_row_norms_kernel, norms, lora, {"eps0", "eps1", "eps2"}), 4),
        ("row_norms MTP embedding gather + hidden 6144", _source(_row_norms_kernel, norms, mtp_in, {"eps0", "eps1", "eps2"}), 16),
        ("silu_mul shared expert", _source(_silu_mul_kernel, silu, {"K": 1, "ROUTED": False, "BLOCK": 1024}, set()), 4),
        ("silu_mul every expert routed, top-8", _source(_silu_mul_kernel, silu, {"K": 8, "ROUTED": True, "BLOCK": 1024}, set()), 4),
        ("rms_norm kv_lora 512", _source(_rms_norm_kernel, bf16, {"HAS_RESIDUAL": False, "BLOCK_D": 512}, {"eps"}), 1),
        ("rope q_pe 64 heads x 64", _source(_rope_kernel, rope, {"NUM_X": 1, "INTERLEAVED": True, "BLOCK_H": 64, "BLOCK_F": 32, "BLOCK_R": 1, "EXACT": True}, set()), 4),
        ("rope indexer q 32 x 128", _source(_rope_kernel, rope, {"NUM_X": 1, "INTERLEAVED": True, "BLOCK_H": 32, "BLOCK_F": 32, "BLOCK_R": 64, "EXACT": True}, set()), 4),
        ("rope NeoX partial", _source(_rope_kernel, rope, {"NUM_X": 1, "INTERLEAVED": False, "BLOCK_H": 16, "BLOCK_F": 32, "BLOCK_R": 64, "EXACT": True}, set()), 4),
        ("rope DSA layer 4 tensors", _source(_rope_kernel, rope, {"NUM_X": 4, "INTERLEAVED": True, "BLOCK_H": 32, "BLOCK_F": 32, "BLOCK_R": 64, "EXACT": True}, set()), 4),
        ("route 256 experts top-8", _source(_route_kernel, route, {"TOP_K": 8, "BLOCK_K": 8, "N_GROUP": 1, "TOPK_GROUP": 1, "NORM": True, "BLOCK_E": 256}, {"scaling"}), 4),
        ("route 8 x 32 groups top-4", _source(_route_kernel, route, {"TOP_K": 8, "BLOCK_K": 8, "N_GROUP": 8, "TOPK_GROUP": 4, "NORM": True, "BLOCK_E": 256}, {"scaling"}), 4),
        ("router_logits 256 experts x 6144", _source(_router_logits_kernel, gate, {"BLOCK_E": 2, "BLOCK_H": 1024, "NUM_STAGES": 3}, set()), 4),
        ("selection keys", _source(_selection_keys_kernel, {"scores_ptr": "fp32", "keys_ptr": "i64"}, {"BLOCK": 1024}, set()), 4),
        ("selection radix 2176 columns", _source(_radix_select_kernel, radix, {"BLOCK": 2048, "TAIL": 256}, set()), 16),
        ("selection radix 1500 columns", _source(_radix_select_kernel, radix, {"BLOCK": 1024, "TAIL": 128}, set()), 8),
        ("selection radix resident 2176 columns", _source(_radix_resident_kernel, radix, {"BLOCK": 4096}, set()), 16),
        ("selection radix resident 8192 columns", _source(_radix_resident_kernel, radix, {"BLOCK": 8192}, set()), 16),
        ("verify rows' argmax, 12 banned ids", _source(_row_argmax_kernel, argmax, {"S": 12, "BLOCK_V": 1024}, set()), 4),
        ("verify acceptance k = 3, 66 slices", _source(_accept_kernel, accept, {"L": 4, "BLOCK_P": 128}, set()), 4),
    ]  # fmt: skip


def main() -> None:
    for name, src, warps in builds():
        print(f"{name}: {compile_sm90(src, warps)}")


if __name__ == "__main__":
    main()
