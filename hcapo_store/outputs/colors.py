"""One diverging colour scale for the HTML pages, safe for colour-blind readers.

Orange for below (unlikely token, rho under 1, negative credit), white in the middle,
purple for above — ColorBrewer's PuOr ends, which stay apart under protanopia,
deuteranopia and tritanopia (red/green do not). Each background comes with the text colour
(near-black or white) that reads best on it; the tests hold every pair to WCAG's 4.5:1.
"""

from __future__ import annotations

LOW = (230, 97, 1)  # PuOr #e66101
HIGH = (94, 60, 153)  # PuOr #5e3c99
MID = (255, 255, 255)
DARK_TEXT = (0, 0, 0)
LIGHT_TEXT = (255, 255, 255)


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _luminance(rgb: tuple[int, int, int]) -> float:
    """WCAG relative luminance."""

    def channel(c: int) -> float:
        s = c / 255
        return s / 12.92 if s <= 0.04045 else ((s + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    """WCAG contrast ratio of two colours (1 … 21)."""
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def diverging_rgb(x: float) -> tuple[int, int, int]:
    """``x`` in [-1, 1] (clamped): LOW at -1, white at 0, HIGH at 1."""
    x = max(-1.0, min(1.0, x))
    end = HIGH if x >= 0 else LOW
    t = abs(x)
    return tuple(round(m + (e - m) * t) for m, e in zip(MID, end))  # type: ignore[return-value]


def text_on(background: tuple[int, int, int]) -> tuple[int, int, int]:
    """The text colour with the higher contrast on ``background``."""
    return max((DARK_TEXT, LIGHT_TEXT), key=lambda t: contrast(t, background))


def diverging(x: float) -> tuple[str, str]:
    """(background, text) as CSS hex colours for ``x`` in [-1, 1]."""
    bg = diverging_rgb(x)
    return _hex(bg), _hex(text_on(bg))


def legend_gradient() -> str:
    """The CSS gradient of the scale, low to high."""
    return f"linear-gradient(90deg,{_hex(LOW)},{_hex(MID)},{_hex(HIGH)})"


PAGE_TEXT = (34, 34, 34)  # the pages' body text (#222)
TINT_MAX = 0.6  # message backgrounds stop here, so body text keeps >= 4.5:1 on them


def tint(x: float) -> str:
    """A message background for ``x`` in [-1, 1]: the scale up to TINT_MAX, under body text."""
    return _hex(diverging_rgb(max(-1.0, min(1.0, x)) * TINT_MAX))
