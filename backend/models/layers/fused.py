"""Linears that read the same input, fused after loading: one product, each output a view of it.

A decode step at concurrency 1 is launch-bound (issue 24: GLM 5.2 at 10 layers, 3.9 ms a step
against ~1.2 ms of weight bytes), so every Linear saved is a launch saved. vLLM stacks MLA's
`q_a_proj` and `kv_a_proj_with_mqa` into one `fused_qkv_a_proj`, and a dense MLP's gate and up
projections into `gate_up_proj`; `fuse_projections(model)` does the same to a loaded model, where
each module that has such a group says so (`fuse_projections()` on MLA attention, DSA attention and
the dense MLP). A DSA "full" layer also stacks q_b_proj with its indexer's wq_b (both read the normed
q LoRA activation) as `fused_q_b_proj`. The checkpoint's names stay the public names: the parts are
loaded under them, then replaced by one `FusedLinear` whose call returns the parts' outputs, in the
caller's order, as views of one product's columns (no copies) — or only the first parts' outputs
(`num_parts`; the DSA step that scores nothing asks q_b_proj alone), from a row-prefix view of the
stacked weight and its scales (`rows` on the Linears), so the others' bytes are not read.

Stacking is exact in every weight format, since a row of the product reads only its own weight row
and that row's scales (`stacked` on `Linear`, `Int4Linear`, `Fp8Linear`): BF16 rows; INT4 rows with
their group scales; FP8 rows with their channel scales, or with 128×128 block scales when every part
but the last fills whole blocks of rows, so the parts are ordered with those first, and a second
part ending inside a block is left out of the stack (it runs on its own); a row prefix of whole-block
parts ends on a block, so its scales are a prefix too (one that takes the ragged part is the whole
stack: asking for it alone reads every row, as when q_b_proj's rows end inside a block and wq_b's
do not, which GLM-5's 8 ranks × 8 heads × 256 rows never do). Parts of different formats
(a checkpoint that quantizes some and not others) stack by format. Row-parallel Linears never stack;
replicated ones do, and column-parallel ones on each rank its own rows. The products are the same
ones, one launch instead of several; GPU kernels may reduce a wider product in another order, so the
outputs agree to the format's rounding, not always to the bit.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn


class FusedLinear(nn.Module):
    """Parts that read the same input `x [..., K]`: `linears[i]` computes the parts `rows[i]` names,
    side by side; `order` says where each requested part's output is (linear, piece)."""

    def __init__(self, linears: list[nn.Module], rows: list[list[int]], order: list[tuple[int, int]]) -> None:
        super().__init__()
        self.linears = nn.ModuleList(linears)
        self.rows, self.order = rows, order

    @classmethod
    def of(cls, parts: list[nn.Module]) -> FusedLinear:
        """The parts (loaded Linears of any format, in the order the caller wants their outputs),
        stacked where exact."""
        groups: dict[Hashable, list[int]] = {}
        for i, p in enumerate(parts):
            key = cast(Any, p).stack_key() if hasattr(p, "stack_key") else None
            groups.setdefault(("alone", i) if key is None else key, []).append(i)
        linears: list[nn.Module] = []
        rows: list[list[int]] = []
        order: dict[int, tuple[int, int]] = {}
        for members in groups.values():
            for stack in _stacks([parts[i] for i in members], members):
                modules = [parts[i] for i in stack]
                order |= {i: (len(linears), j) for j, i in enumerate(stack)}
                stacked = cast(Any, type(modules[0])).stacked
                linears.append(stacked(modules) if len(modules) > 1 else modules[0])
                rows.append([_rows(m) for m in modules])
        return cls(linears, rows, [order[i] for i in range(len(parts))])

    @property
    def num_products(self) -> int:
        return len(self.linears)

    if TYPE_CHECKING:  # nn.Module types every call `(...) -> Any`

        def __call__(self, x: torch.Tensor, num_parts: int | None = None) -> tuple[torch.Tensor, ...]: ...

    def forward(self, x: torch.Tensor, num_parts: int | None = None) -> tuple[torch.Tensor, ...]:
        """x [..., K] → each part's output [..., N_part], a view of its stack's product. `num_parts`:
        only the first parts' outputs; a stack computes its rows up to the last piece asked of it
        (a row-prefix view of its weight and scales, `rows` on the Linears), a stack asked nothing
        not at all."""
        order = self.order[:num_parts]
        asked = [  # the pieces each stack computes
            len(n) if num_parts is None else max((j + 1 for i, j in order if i == s), default=0)
            for s, n in enumerate(self.rows)
        ]
        pieces: list[tuple[torch.Tensor, ...]] = []
        for m, n, k in zip(self.linears, self.rows, asked, strict=True):
            # fewer pieces end on a whole block of rows (`_stacks` puts a ragged part last)
            y = None if k == 0 else m(x) if k == len(n) else m(x, rows=sum(n[:k]))
            pieces.append(() if y is None else torch.split(y, n[:k], dim=-1) if k > 1 else (y,))
        return tuple(pieces[i][j] for i, j in order)


def _rows(m: Any) -> int:
    return int(m.out_local if hasattr(m, "out_local") else m.weight.shape[0])


def _stacks(parts: list[Any], ids: list[int]) -> list[list[int]]:
    """Same-format parts → stacks of their ids: those filling whole scale blocks of rows first, then
    one that does not; any further such part alone."""
    whole = [i for p, i in zip(parts, ids, strict=True) if _rows(p) % p.row_block == 0]
    ragged = [i for i in ids if i not in whole]
    return [whole + ragged[:1], *([i] for i in ragged[1:])]


def fuse_group(owner: nn.Module, names: list[str], fused_name: str) -> bool:
    """Replace `owner`'s submodules `names` (dotted paths below it) by one `FusedLinear` under
    `fused_name`, calling them in that order; False (nothing changed) when already fused or when
    no two of them stack."""
    if hasattr(owner, fused_name) and getattr(owner, fused_name) is not None:
        return False
    fused = FusedLinear.of([owner.get_submodule(n) for n in names])
    if fused.num_products == len(names):
        return False
    for name in names:
        parent, _, child = name.rpartition(".")
        delattr(owner.get_submodule(parent) if parent else owner, child)
    setattr(owner, fused_name, fused)
    return True


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse every same-input group of a loaded model (modules with `fuse_projections()`); returns
    how many groups were fused (an owner may fuse more than one). Idempotent."""
    owners: list[Any] = [m for m in model.modules() if hasattr(m, "fuse_projections")]
    return sum(int(m.fuse_projections()) for m in owners)


def project(
    owner: nn.Module,
    names: list[str],
    fused: FusedLinear | None,
    x: torch.Tensor,
    num_parts: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """x [..., K] → the outputs of `owner`'s Linears `names` (only the first `num_parts`), in that
    order: views of one product once `fused` (their `fuse_group`), else each its own."""
    if fused is not None:
        return fused(x, num_parts)
    return tuple(owner.get_submodule(name)(x) for name in names[:num_parts])
