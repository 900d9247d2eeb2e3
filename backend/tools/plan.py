"""`kumo plan`: how a checkpoint fits on a GPU host — weight bytes per GPU and KV tokens that fit.

Computed from config.json alone (tensor shapes from `backend.tools.tensor_inventory`, formats from
`backend.quant.scheme`), and printed term by term so a reader can redo it by hand:

    usable      = gpu_mem × mem_fraction                 (the rest: CUDA context, NCCL, fragmentation)
    weights     = Σ tensors  bytes held × (1/tp if sharded else 1)       (MTP layers only with
                  --speculative, less their embedding and head copies; held = stored, but
                  kv_b_proj dense and the router's weight in fp32)
    activations = peak live buffers of one prefill chunk and one decode batch's logits
    kv_pool     = usable − weights − activations
    kv_tokens   = ⌊kv_pool / bytes per token⌋, rounded down to whole pages
                  (with dcp: a rank holds 1/dcp of every sequence's tokens, so its bytes per token are
                  the latent's / dcp, and a page id spans page_size·dcp tokens)

Sharding follows vLLM's tensor parallelism: q_a_proj, kv_a_proj_with_mqa, the DSA indexer, the
router, norms and the vision tower are replicated on every rank; everything else is split by tp;
GQA K/V heads are split down to one head per rank and replicated past that; the embedding and
lm_head are vocab parallel. The MLA latent cache is replicated on every rank without decode context
parallelism, so its bytes per token do not shrink with tp; with `--dcp N` (MLA only, N divides tp)
groups of N ranks shard it by token (backend/models/layers/context_parallel.py), and GLM-5's indexer keys
with it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Literal

import msgspec

from backend.quant.scheme import READ_AS_MATRIX, QuantScheme, parse_config, scheme_from_config
from backend.tools.tensor_inventory import (
    FP32,
    TensorSpec,
    checkpoint_tensors,
    has_indexer,
    has_own_indexer,
    is_mla,
    layer_index,
    tensor_class,
    text_config,
)
from schemas.backend import parse_speculative

WeightFormat = Literal["native", "bf16", "fp8-channel", "fp8-block", "int4-g32", "int4-g128"]
KvDtype = Literal["bf16", "fp8"]
GB, GIB = 10**9, 2**30
_REPLICATED = re.compile(
    r"(q_a_proj|kv_a_proj_with_mqa|self_attn\.indexer\.|mlp\.gate\.|norm|vision_tower\.|mm_projector\.)"
)


class Term(msgspec.Struct, frozen=True):
    name: str
    bytes: int
    reason: str


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    weights: str
    kv_dtype: KvDtype
    tp: int
    dcp: int = 1
    checkpoint_bytes: int  # the whole checkpoint on disk in this format, MTP layers included
    weights_per_gpu: int
    weights_per_gpu_by_class: dict[str, int]  # tensor class (backend/tools/tensor_inventory.py) -> bytes
    terms: list[Term]  # usable memory, then everything subtracted from it
    kv_bytes_per_token: int  # per GPU (with dcp: the group's average, latent / dcp), all served layers
    kv_bytes_per_token_per_layer: dict[str, int]
    kv_layers_per_tensor: dict[str, int]  # how many layers cache each tensor (DSA: shared indexers don't)
    kv_pool_bytes: int
    kv_tokens: int


def scheme_for(config: dict[str, Any], weights: WeightFormat, all_linear: bool) -> QuantScheme | None:
    if weights == "native":
        raw = config.get("quantization_config") or text_config(config).get("quantization_config")
        return scheme_from_config(parse_config(raw)) if raw else None
    if weights == "bf16":
        return None
    if weights.startswith("int4"):
        return QuantScheme.build(
            "int4", group_size=int(weights.removeprefix("int4-g")), all_linear=all_linear
        )
    return QuantScheme.build(weights, all_linear=all_linear)  # type: ignore[arg-type]


def stored_bytes(spec: TensorSpec, scheme: QuantScheme | None) -> int:
    """Bytes of one tensor on disk and in memory, with the scales its format adds."""
    if scheme is None or not spec.is_linear or not scheme.applies_to(spec.served_module):
        return spec.numel * spec.dtype_bytes
    n, k = spec.shape
    if scheme.method == "int4":  # weight_packed int32, weight_scale bf16, weight_shape int32[2]
        return n * math.ceil(k / 8) * 4 + n * math.ceil(k / scheme.group_size) * 2 + 8
    if scheme.method == "fp8-channel":  # weight e4m3, weight_scale fp32 [N, 1]
        return n * k + n * 4
    bn, bk = scheme.block  # weight e4m3, weight_scale_inv fp32 [N/128, K/128]
    return n * k + math.ceil(n / bn) * math.ceil(k / bk) * 4


def shard_fraction(spec: TensorSpec, tc: dict[str, Any], tp: int) -> float:
    if _REPLICATED.search(spec.name):
        return 1.0
    if re.search(r"\.(k_proj|v_proj)\.", spec.name):
        kvh: int = tc["num_key_value_heads"]
        return math.ceil(kvh / tp) / kvh
    return 1.0 / tp


def kv_bytes_per_layer(tc: dict[str, Any], kv_dtype: KvDtype, tp: int) -> dict[str, int]:
    """Bytes per token per served layer, per cached tensor, on one GPU."""
    b = 1 if kv_dtype == "fp8" else 2
    if is_mla(tc):
        out = {"latent": (tc["kv_lora_rank"] + tc["qk_rope_head_dim"]) * b}
        if has_indexer(tc):
            out["index_k"] = tc["index_head_dim"] * b
        return out
    hd = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
    kvh_rank = math.ceil(tc["num_key_value_heads"] / tp)
    return {"k": kvh_rank * hd * b, "v": kvh_rank * hd * b}


def activation_terms(tc: dict[str, Any], tp: int, chunk: int, max_seqs: int, dcp: int = 1) -> list[Term]:
    h, heads = tc["hidden_size"], math.ceil(tc["num_attention_heads"] / tp)
    if dcp > 1:  # absorbed attention over the shard for the DCP group's heads
        group, latent = heads * dcp, tc["kv_lora_rank"] + tc["qk_rope_head_dim"]
        attn = chunk * group * (latent * 2 + 2 * tc["kv_lora_rank"] * 4)
        attn_why = (
            f"DCP prefill: q gathered for the group's {group} heads × {latent}, bf16; "
            f"partial and weighted outputs × {tc['kv_lora_rank']}, fp32"
        )
    elif is_mla(tc):
        qk, v = tc["qk_nope_head_dim"] + tc["qk_rope_head_dim"], tc["v_head_dim"]
        attn = chunk * heads * (2 * qk + 2 * v) * 2
        attn_why = f"MLA prefill q, k ({qk}) and v, out ({v}) for {heads} heads/rank, bf16"
    else:
        hd = tc.get("head_dim") or h // tc["num_attention_heads"]
        kvh = math.ceil(tc["num_key_value_heads"] / tp)
        attn = chunk * (2 * heads + 2 * kvh) * hd * 2
        attn_why = f"GQA prefill q, out ({heads} heads/rank) and k, v ({kvh} heads/rank) × {hd}, bf16"
    topk, inter = tc.get("num_experts_per_tok", 1), tc.get("moe_intermediate_size") or tc["intermediate_size"]
    moe = chunk * topk * (2 * math.ceil(inter / tp) + h) * 2
    return [
        Term(
            "activations: hidden + residual",
            2 * chunk * h * 2,
            f"{chunk}-token prefill chunk × {h}, bf16, two live copies",
        ),
        Term("activations: attention", attn, f"{chunk} tokens: {attn_why}"),
        Term(
            "activations: MoE",
            moe,
            f"{chunk} tokens × top-{topk}: gate_up ({2 * math.ceil(inter / tp)}/rank) and down ({h}) outputs, bf16",
        ),
        Term(
            "activations: logits",
            max_seqs * tc["vocab_size"] * 4,
            f"{max_seqs} sequences × vocab {tc['vocab_size']}, fp32, gathered on every rank",
        ),
    ]


def make_plan(
    config: dict[str, Any],
    *,
    model: str = "",
    gpu_mem: int,
    tp: int,
    weights: WeightFormat = "native",
    all_linear: bool = False,
    kv_dtype: KvDtype = "bf16",
    dcp: int = 1,
    mem_fraction: float = 0.90,
    chunk: int = 8192,
    max_seqs: int = 256,
    page_size: int = 16,
    mtp: bool = False,
) -> Plan:
    """`mtp`: the checkpoint's MTP layers are loaded (speculative decoding): their weights (not
    their copies of the embedding and lm_head) and a KV layer slot each count."""
    tc = text_config(config)
    if dcp < 1 or tp % dcp:
        raise ValueError(f"--dcp {dcp} must divide --tp {tp}")
    if dcp > 1 and not is_mla(tc):
        raise ValueError("--dcp shards the MLA latent cache: this model has none (GQA)")
    scheme = scheme_for(config, weights, all_linear)
    num_layers = tc["num_hidden_layers"]
    with_mtp, num_mtp = mtp, tc.get("num_nextn_predict_layers", 0) if mtp else 0
    checkpoint = per_gpu = mtp_bytes = 0.0
    by_class: dict[str, float] = {}
    for spec in checkpoint_tensors(config):
        size = stored_bytes(spec, scheme)
        checkpoint += size
        idx = layer_index(spec.name)
        is_mtp = idx is not None and idx >= num_layers
        # MTP tensors not loaded: all without --speculative, else the embedding and head copies
        if is_mtp and (not with_mtp or re.search(r"\.(embed_tokens|shared_head\.head)\.", spec.name)):
            mtp_bytes += size
            continue
        if spec.module.rpartition(".")[2] in READ_AS_MATRIX:  # dequantized at load, held dense
            size = spec.numel * spec.dtype_bytes
        if tensor_class(spec.name) == "router":  # the Router holds its weight in fp32 (stored BF16)
            size = spec.numel * FP32
        share = size * shard_fraction(spec, tc, tp)
        per_gpu += share
        by_class[tensor_class(spec.name)] = by_class.get(tensor_class(spec.name), 0.0) + share
    usable = int(gpu_mem * mem_fraction)
    terms = [
        Term(
            "usable memory",
            usable,
            f"{gpu_mem / GIB:.1f} GiB × {mem_fraction}: the rest is CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation",
        ),
        Term(
            "weights",
            -int(per_gpu),
            f"checkpoint {checkpoint / GB:.1f} GB; replicated: q_a/kv_a, indexer, router, norms, vision; the rest / tp={tp}"
            + (f"; MTP layers ({mtp_bytes / GB:.1f} GB) not loaded" if mtp_bytes and not with_mtp else "")
            + (f"; {num_mtp} MTP layer(s) loaded (speculative decoding)" if num_mtp else "")
            + ("; kv_b_proj held dense (MLA absorption)" if scheme and is_mla(tc) else "")
            + "; router weights held in fp32",
        ),
    ]
    terms += [Term(t.name, -t.bytes, t.reason) for t in activation_terms(tc, tp, chunk, max_seqs, dcp)]
    pool = sum(t.bytes for t in terms)
    per_layer = kv_bytes_per_layer(tc, kv_dtype, tp)
    layers_with = {  # an MTP layer keeps its own KV (and GLM-5's its own indexer keys)
        name: (sum(has_own_indexer(tc, i) for i in range(num_layers)) if name == "index_k" else num_layers)
        + num_mtp
        for name in per_layer
    }
    per_token = sum(per_layer[name] * layers_with[name] for name in per_layer)  # one token, one rank
    # a rank's pages hold page_size of its own tokens each; the group holds dcp times as many
    tokens = max(0, pool) // (per_token * page_size) * page_size * dcp
    return Plan(
        model=model,
        weights=weights + (" --all-linear" if all_linear else ""),
        kv_dtype=kv_dtype,
        tp=tp,
        dcp=dcp,
        checkpoint_bytes=int(checkpoint),
        weights_per_gpu=int(per_gpu),
        weights_per_gpu_by_class={k: int(v) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        terms=terms,
        kv_bytes_per_token=per_token // dcp,
        kv_bytes_per_token_per_layer=per_layer,
        kv_layers_per_tensor=layers_with,
        kv_pool_bytes=pool,
        kv_tokens=tokens,
    )


def render(plan: Plan) -> str:
    lines = [
        f"{plan.model}: weights {plan.weights}, KV {plan.kv_dtype}, tp {plan.tp}"
        + (f", dcp {plan.dcp}" if plan.dcp > 1 else ""),
        f"  checkpoint          {plan.checkpoint_bytes / GB:10.1f} GB  ({plan.checkpoint_bytes / GIB:.1f} GiB)",
        f"  weights per GPU     {plan.weights_per_gpu / GB:10.1f} GB  ({plan.weights_per_gpu / GIB:.1f} GiB)",
    ]
    lines += [f"    {k:<16} {v / GIB:9.2f} GiB" for k, v in plan.weights_per_gpu_by_class.items()]
    lines.append("  per GPU:")
    for t in plan.terms:
        lines.append(f"    {t.name:<32} {t.bytes / GIB:+9.2f} GiB   {t.reason}")
    lines.append(f"    {'= KV pool':<32} {plan.kv_pool_bytes / GIB:+9.2f} GiB")
    parts = " + ".join(
        f"{plan.kv_layers_per_tensor[k]} layers × {k} {v} B"
        for k, v in plan.kv_bytes_per_token_per_layer.items()
    )
    if plan.dcp > 1:
        parts = f"({parts}) / dcp {plan.dcp}"
    lines.append(f"  KV bytes per token  {parts} = {plan.kv_bytes_per_token:,} B")
    lines.append(f"  KV tokens that fit  {plan.kv_tokens:,}")
    return "\n".join(lines)


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*(GiB|GB|MiB|MB|TiB|TB)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 141GiB, 80GB)")
    unit = {"GiB": GIB, "GB": GB, "MiB": 2**20, "MB": 10**6, "TiB": 2**40, "TB": 10**12, None: GIB}[
        m.group(2)
    ]
    return int(float(m.group(1)) * unit)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="kumo plan", description="Weight memory per GPU and KV tokens that fit."
    )
    ap.add_argument(
        "--model", required=True, type=Path, help="checkpoint or config-only folder (config.json)"
    )
    ap.add_argument(
        "--gpu-mem", type=parse_bytes, default=parse_bytes("141GB"), help="memory per GPU, e.g. 141GB, 80GiB"
    )
    ap.add_argument("--tp", type=int, default=8, help="GPUs (tensor-parallel size)")
    ap.add_argument("--weights", default="native", choices=list(WeightFormat.__args__))  # type: ignore[attr-defined]
    ap.add_argument(
        "--all-linear", action="store_true", help="quantize every Linear but router, embeddings, lm_head"
    )
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument(
        "--dcp",
        type=int,
        default=1,
        help="decode context parallel: ranks sharing one MLA latent cache by token",
    )
    ap.add_argument("--mem-fraction", type=float, default=0.90)
    ap.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--speculative",
        default="off",
        metavar="mtp:K",
        help="count the MTP layers speculative decoding loads",
    )
    ap.add_argument("--json", type=Path, help="also write the plan here")
    a = ap.parse_args(argv)
    try:
        config = json.loads((a.model / "config.json").read_text())
        plan = make_plan(
            config,
            model=a.model.name,
            gpu_mem=a.gpu_mem,
            tp=a.tp,
            weights=a.weights,
            all_linear=a.all_linear,
            kv_dtype=a.kv_dtype,
            dcp=a.dcp,
            mem_fraction=a.mem_fraction,
            chunk=a.chunk,
            max_seqs=a.max_seqs,
            page_size=a.page_size,
            mtp=parse_speculative(a.speculative) > 0,
        )
    except (OSError, ValueError) as exc:
        print(f"kumo plan: error: {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(f"kumo plan: error: {a.model / 'config.json'} has no {exc}", file=sys.stderr)
        return 2
    print(render(plan))
    if a.json:
        a.json.write_bytes(msgspec.json.encode(plan))
    return 0 if plan.kv_tokens > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
