"""Types of the optional C extension ``_jpegroi.c`` (a JPEG region decoded by libjpeg-turbo).

Each function takes the JPEG as any bytes-like object. See the C source for the full contract.
"""

from typing_extensions import Buffer

def header(data: Buffer, /) -> tuple[int, int, int]:
    """``(height, width, jpeg_color_space)``; ValueError on any libjpeg error or warning."""

def structure_ok(data: Buffer, /) -> bool:
    """Whether a region decode that stops early cannot hide a structural error."""

def decode_region(
    data: Buffer, top: int, left: int, height: int, width: int, margin: int = ..., /
) -> tuple[bytearray, int, int]:
    """``(rgb_rows, x0, out_width)``: RGB rows ``[top, top+height)``, columns ``[x0, x0+out_width)``.

    IndexError for a region outside the image; ValueError on any libjpeg error or warning, or
    CMYK/YCCK input.
    """
