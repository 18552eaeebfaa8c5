"""A scatter plot written as a PNG with the standard library only (zlib + struct).

The project's environment has no plotting library, and a benchmark figure does not justify one:
this draws axes with numbered ticks, labelled points and text in a 5x7 bitmap font (upper
case, digits, a little punctuation) onto an RGB canvas and encodes it as an 8-bit RGB PNG.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from pathlib import Path
from typing import Sequence

RGB = tuple[int, int, int]

# 5x7 glyphs, one 5-bit row per entry, top row first (lower case is drawn as upper case).
_FONT: dict[str, tuple[int, ...]] = {
    "0": (0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E), "1": (0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "2": (0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F), "3": (0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E),
    "4": (0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02), "5": (0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E),
    "6": (0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E), "7": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08),
    "8": (0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E), "9": (0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C),
    "A": (0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11), "B": (0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E),
    "C": (0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E), "D": (0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C),
    "E": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F), "F": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10),
    "G": (0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F), "H": (0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11),
    "I": (0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E), "J": (0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C),
    "K": (0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11), "L": (0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F),
    "M": (0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11), "N": (0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11),
    "O": (0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E), "P": (0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10),
    "Q": (0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D), "R": (0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11),
    "S": (0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E), "T": (0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04),
    "U": (0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E), "V": (0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04),
    "W": (0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A), "X": (0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11),
    "Y": (0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04), "Z": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F),
    ".": (0, 0, 0, 0, 0, 0x0C, 0x0C), "-": (0, 0, 0, 0x1F, 0, 0, 0),
    "+": (0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0), ":": (0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0),
    "/": (0, 0x01, 0x02, 0x04, 0x08, 0x10, 0), "%": (0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03),
    "(": (0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02), ")": (0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08),
    "=": (0, 0, 0x1F, 0, 0x1F, 0, 0), ",": (0, 0, 0, 0, 0x0C, 0x04, 0x08),
    "[": (0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E), "]": (0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E),
    "<": (0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02), ">": (0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08),
    " ": (0, 0, 0, 0, 0, 0, 0),
}
UNKNOWN_GLYPH = (0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F)
WHITE: RGB = (255, 255, 255)
BLACK: RGB = (0, 0, 0)
GREY: RGB = (200, 200, 200)


class Canvas:
    def __init__(self, width: int, height: int, background: RGB = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: RGB) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def get(self, x: int, y: int) -> RGB:
        i = 3 * (y * self.width + x)
        return self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]

    def line(self, x0: int, y0: int, x1: int, y1: int, color: RGB) -> None:
        """Bresenham."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.set(x0, y0, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def disc(self, cx: int, cy: int, radius: int, color: RGB) -> None:
        for y in range(cy - radius, cy + radius + 1):
            for x in range(cx - radius, cx + radius + 1):
                if (x - cx) ** 2 + (y - cy) ** 2 <= radius * radius:
                    self.set(x, y, color)

    def text(self, x: int, y: int, text: str, color: RGB = BLACK, *, scale: int = 1) -> None:
        """Top-left at (x, y); 6 * scale pixels per character."""
        for n, ch in enumerate(text.upper()):
            rows = _FONT.get(ch, UNKNOWN_GLYPH)
            for r, bits in enumerate(rows):
                for c in range(5):
                    if bits >> (4 - c) & 1:
                        for dy in range(scale):
                            for dx in range(scale):
                                self.set(x + (n * 6 + c) * scale + dx, y + r * scale + dy, color)

    def png(self) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride])
                       for y in range(self.height))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


@dataclasses.dataclass(frozen=True)
class Point:
    x: float
    y: float
    color: RGB
    label: str = ""
    radius: int = 4


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    step = (hi - lo) / n
    magnitude = 10 ** math.floor(math.log10(step))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= step)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def scatter_png(path: str | Path, points: Sequence[Point], *, title: str, x_label: str,
                y_label: str, width: int = 720, height: int = 480,
                hlines: Sequence[tuple[float, RGB]] = (),
                vlines: Sequence[tuple[float, RGB]] = ()) -> Path:
    """Write a scatter plot of `points` (with optional reference lines) to `path`."""
    if not points:
        raise ValueError("nothing to plot")
    left, right, top, bottom = 70, 110, 56, 50
    xs = [p.x for p in points] + [v for v, _ in vlines]
    ys = [p.y for p in points] + [v for v, _ in hlines]
    x_pad = (max(xs) - min(xs)) * 0.08 or 0.5
    y_pad = (max(ys) - min(ys)) * 0.08 or 0.5
    x_lo, x_hi, y_lo, y_hi = min(xs) - x_pad, max(xs) + x_pad, min(ys) - y_pad, max(ys) + y_pad
    canvas = Canvas(width, height)
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> int:
        return left + round((x - x_lo) / (x_hi - x_lo) * plot_w)

    def py(y: float) -> int:
        return top + round((y_hi - y) / (y_hi - y_lo) * plot_h)

    for t in _ticks(x_lo, x_hi):
        canvas.line(px(t), top, px(t), top + plot_h, GREY)
        label = f"{t:g}"
        canvas.text(px(t) - 3 * len(label), top + plot_h + 6, label)
    for t in _ticks(y_lo, y_hi):
        canvas.line(left, py(t), left + plot_w, py(t), GREY)
        label = f"{t:.3g}"
        canvas.text(left - 6 * len(label) - 4, py(t) - 3, label)
    for value, color in hlines:
        canvas.line(left, py(value), left + plot_w, py(value), color)
    for value, color in vlines:
        canvas.line(px(value), top, px(value), top + plot_h, color)
    canvas.line(left, top + plot_h, left + plot_w, top + plot_h, BLACK)
    canvas.line(left, top, left, top + plot_h, BLACK)
    for p in points:
        canvas.disc(px(p.x), py(p.y), p.radius, p.color)
        if p.label:
            canvas.text(px(p.x) + p.radius + 3, py(p.y) - 3, p.label, p.color)
    canvas.text(left, 12, title, scale=2)
    canvas.text(left + plot_w // 2 - 3 * len(x_label), height - 18, x_label)
    canvas.text(4, top - 12, y_label)
    out = Path(path)
    out.write_bytes(canvas.png())
    return out
