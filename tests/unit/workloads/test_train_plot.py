"""The stdlib PNG scatter plot the Pareto benchmark writes: a valid 8-bit RGB PNG whose pixels
are where the points and reference lines were put."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from sparsegate_workload.training.png_plot import Canvas, Point, scatter_png


def _decode(data: bytes) -> tuple[int, int, bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, color_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color_type) == (8, 2) and b"IEND" in chunks
    return width, height, zlib.decompress(chunks[b"IDAT"])


def _pixel(raw: bytes, width: int, x: int, y: int) -> tuple[int, ...]:
    row = raw[y * (3 * width + 1):(y + 1) * (3 * width + 1)]
    assert row[0] == 0  # filter type None
    return tuple(row[1 + 3 * x:4 + 3 * x])


def test_canvas_round_trips_through_png() -> None:
    canvas = Canvas(20, 10)
    canvas.disc(5, 5, 2, (10, 200, 30))
    canvas.line(0, 0, 19, 0, (1, 2, 3))
    width, height, raw = _decode(canvas.png())
    assert (width, height) == (20, 10)
    assert _pixel(raw, width, 5, 5) == (10, 200, 30)
    assert _pixel(raw, width, 12, 0) == (1, 2, 3)
    assert _pixel(raw, width, 15, 8) == (255, 255, 255)


def test_scatter_draws_points_and_text(tmp_path: Path) -> None:
    path = scatter_png(tmp_path / "p.png", [Point(1.0, 5.0, (200, 0, 0), label="TOP-2"),
                                            Point(2.0, 4.0, (0, 0, 200))],
                       title="T", x_label="X", y_label="Y", width=300, height=200)
    width, height, raw = _decode(path.read_bytes())
    colors = {_pixel(raw, width, x, y) for x in range(width) for y in range(height)}
    assert {(200, 0, 0), (0, 0, 200), (0, 0, 0)} <= colors


def test_empty_plot_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to plot"):
        scatter_png(tmp_path / "p.png", [], title="T", x_label="X", y_label="Y")
