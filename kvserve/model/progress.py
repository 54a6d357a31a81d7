"""Progress bars for the slow steps of loading a model (dequantizing a checkpoint, packing its weights).

Shown on a terminal only (tqdm's disable=None), so server logs and test output stay free of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], description: str, unit: str, total: int | None = None) -> Iterator[T]:
    yield from tqdm(items, desc=description, unit=unit, total=total, disable=None, leave=False, dynamic_ncols=True)
