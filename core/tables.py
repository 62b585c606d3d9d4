"""Plain-text tables for the CLIs (turnout plugins, explain, tune): columns padded to their widest cell."""

from __future__ import annotations


def print_table(header: list[str], rows: list[list[str]], indent: str = "") -> None:
    """Print header and rows as left-aligned columns two spaces apart, each line after indent."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for r in [header, *rows]:
        print(indent + "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())
