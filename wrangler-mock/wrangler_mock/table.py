"""The box-drawn table wrangler prints (cli-table3's default characters, one space of padding)."""

from __future__ import annotations

from collections.abc import Sequence


def render(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(head, *rows, strict=True)]

    def line(left: str, mid: str, right: str) -> str:
        return left + mid.join("─" * (w + 2) for w in widths) + right

    def row(cells: Sequence[str]) -> str:
        return "│" + "│".join(f" {str(c):<{w}} " for c, w in zip(cells, widths, strict=True)) + "│"

    out = [line("┌", "┬", "┐"), row(head), line("├", "┼", "┤")]
    for index, cells in enumerate(rows):
        if index:
            out.append(line("├", "┼", "┤"))
        out.append(row(cells))
    out.append(line("└", "┴", "┘"))
    return "\n".join(out)
