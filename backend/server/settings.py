"""The backend process's settings: one frozen object built once from argv and the environment.

`kumo backend --model DIR --port N [--host 127.0.0.1] [--listen-fd FD] [--dtype float32|bfloat16]
[--kv-dtype auto|bf16|fp8] [--max-pages N] [--name NAME] [--secret S] [--data-dir DIR]
[--speculative mtp:K] [--no-speculative-graphs] [--no-pdl]
[--tp N] [--ep N] [--dcp N] [--rank-timeout-s S]`

`--tp N` serves the model on N ranks, one process per device (backend/engine/ranks.py); `--ep` expert
groups (default: tp, whole experts per rank) and `--dcp` ranks sharing one MLA latent cache by token
(backend/models/layers/parallel.py). `--page-size` is the KV page of one rank: under DCP a block-manager
page holds page_size·dcp tokens of a sequence.

`--data-dir` (what `kumo serve` passes: its own) keeps the compiled Triton kernels across restarts in
`compile_cache_dir`; without it they go to Triton's default, `~/.triton/cache`.

The shared secret comes from `--secret` or `KUMO_BACKEND_SECRET`; without one the backend refuses
to start, so no one can reach it without the gateway's secret (and pick a tenant salt, or skip
metering). It binds loopback unless told otherwise, and binds first, before it loads anything: a port
in use is an error at once, and no other process takes the port while the model loads.
`--listen-fd` (what `kumo serve` passes): serve on a socket the parent bound (schemas/listen.py)
instead of binding `--host`/`--port`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.backend import MAX_DRAFT_TOKENS, MAX_RANKS, parse_speculative

Port = Annotated[int, Meta(ge=0, le=65535)]
NumPages = Annotated[int, Meta(ge=1, le=1 << 24)]
Secret = Annotated[str, Meta(min_length=8, max_length=512)]
KV_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}


class BackendSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str
    port: Port
    secret: Secret
    host: str = "127.0.0.1"
    listen_fd: Annotated[int, Meta(ge=0)] | None = None  # a bound socket inherited from the parent
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    kv_dtype: Literal["auto", "bf16", "fp8"] = "auto"
    max_pages: NumPages = 1024
    page_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    max_num_seqs: Annotated[int, Meta(ge=1, le=1 << 14)] = 64
    max_num_batched_tokens: Annotated[int, Meta(ge=1, le=1 << 20)] = 2048
    context_window: Annotated[int, Meta(ge=1)] | None = None
    name: str | None = None
    device: str = "cpu"
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (CUDA devices only)
    pdl: bool = True  # Programmatic Dependent Launch of the Triton kernels (sm_90+; kernels/triton_lib.py)
    data_dir: str | None = None
    speculative: Annotated[int, Meta(ge=0, le=MAX_DRAFT_TOKENS)] = 0  # `--speculative mtp:K`: K drafts
    speculative_max_seqs: Annotated[int, Meta(ge=1, le=1 << 14)] = 16  # no drafts past this many running
    speculative_adaptive: bool = True  # draft length per step from load, acceptance (speculative/policy.py)
    speculative_saturation_rows: Annotated[int, Meta(ge=1, le=1 << 20)] = 64  # its cost model's knee
    speculative_draft: str | None = None  # MTP layers shipped apart from the checkpoint (a folder)
    speculative_graphs: bool = True  # verify and draft steps from CUDA graphs (with --cuda-graphs)
    tp: Annotated[int, Meta(ge=1, le=MAX_RANKS)] = 1
    ep: Annotated[int, Meta(ge=0, le=MAX_RANKS)] = 0  # 0: = tp
    dcp: Annotated[int, Meta(ge=1, le=MAX_RANKS)] = 1
    rank_timeout_s: Annotated[float, Meta(gt=0)] = 120.0  # a collective waiting longer fails

    def __post_init__(self) -> None:
        for name in ("ep", "dcp"):
            size = getattr(self, name) or self.tp
            if self.tp % size:
                raise ValueError(f"--{name} ({size}) must divide --tp ({self.tp})")

    @property
    def compile_cache_dir(self) -> Path | None:
        """Where compiled Triton kernels persist, so a restart loads what the warm-up compiled."""
        return Path(self.data_dir) / "compile-cache" / "triton" if self.data_dir is not None else None

    def apply_compile_cache(self) -> None:
        """Point Triton at `compile_cache_dir` (read when the first kernel compiles: call this first)."""
        if self.compile_cache_dir is not None:
            os.environ["TRITON_CACHE_DIR"] = str(self.compile_cache_dir)

    tenant_share: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.5  # of pages and sequences, while others wait
    max_image_patches: Annotated[int, Meta(ge=1)] = 33800  # one request's images together (413 past)
    image_encoders: Annotated[int, Meta(ge=1, le=64)] = 1  # requests encoding images at once
    image_queue: Annotated[int, Meta(ge=0, le=32)] = 16  # more waiting for a turn (429 past it)

    @property
    def model_name(self) -> str:
        return self.name or Path(self.model).name

    @property
    def engine_kv_dtype(self) -> str:
        return KV_DTYPES[self.kv_dtype]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kumo backend", description="Serve one checkpoint over the internal protocol."
    )
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        metavar="FD",
        help="serve on this inherited bound socket instead of binding --host/--port (kumo serve's)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="auto")
    p.add_argument("--max-pages", type=int, default=1024, help="KV pages in the pool")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--context-window", type=int, default=None)
    p.add_argument("--name", default=None, help="model name in the card (default: folder name)")
    p.add_argument("--secret", default=None, help="shared secret (default: $KUMO_BACKEND_SECRET)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--data-dir", default=None, help="state folder: the compile cache (default: none kept)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one process per device")
    p.add_argument("--ep", type=int, default=0, help="expert-parallel groups (default: = --tp)")
    p.add_argument("--dcp", type=int, default=1, help="ranks sharing one MLA latent cache by token")
    p.add_argument(
        "--rank-timeout-s", type=float, default=120.0, help="a rank silent this long fails the group"
    )
    p.add_argument(
        "--tenant-share",
        type=float,
        default=0.5,
        help="most of the KV pages and of --max-num-seqs one tenant may hold while another waits (1: no cap)",
    )
    p.add_argument("--max-image-patches", type=int, default=33800, help="patches of one request's images")
    p.add_argument("--image-encoders", type=int, default=1, help="requests encoding images at once")
    p.add_argument("--image-queue", type=int, default=16, help="requests waiting to encode (429 past it)")
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay decode steps from CUDA graphs per batch size (CUDA devices only; default on)",
    )
    p.add_argument(
        "--pdl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="launch the Triton kernels with Programmatic Dependent Launch, each overlapping the tail of "
        "the one before (Hopper and later; default on; off: to measure what it saves)",
    )
    p.add_argument(
        "--speculative",
        default="off",
        metavar="mtp:K",
        help="speculative decoding: K = 1..3 tokens drafted per step by the checkpoint's MTP layers",
    )
    p.add_argument(
        "--speculative-draft",
        default=None,
        metavar="DIR",
        help="MTP layers shipped apart from the checkpoint (for Kimi K2, which ships none)",
    )
    p.add_argument(
        "--speculative-max-seqs",
        type=int,
        default=16,
        help="draft only while at most this many requests run (default 16)",
    )
    p.add_argument(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="choose the draft length per step from load and measured acceptance (default on; off: always K)",
    )
    p.add_argument(
        "--speculative-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay verify and draft steps from CUDA graphs (default on; off: eager, decode graphs kept)",
    )
    p.add_argument(
        "--speculative-saturation-rows",
        type=int,
        default=64,
        help="the rows at which a forward stops costing the same (the draft policy's cost model, default 64)",
    )
    return p


def build_settings(argv: list[str], environ: Mapping[str, str] | None = None) -> BackendSettings:
    """Parse argv (+ the environment for the secret); raise `SystemExit(2)` with a message on bad input."""
    env = os.environ if environ is None else environ
    parser = _parser()
    args = parser.parse_args(argv)
    secret = args.secret or env.get("KUMO_BACKEND_SECRET")
    if not secret:
        parser.error("a shared secret is required: --secret or KUMO_BACKEND_SECRET")
    values = {k: v for k, v in vars(args).items() if v is not None} | {"secret": secret}
    try:
        values["speculative"] = parse_speculative(args.speculative)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return msgspec.convert(values, BackendSettings)
    except msgspec.ValidationError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
