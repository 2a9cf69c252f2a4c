"""Files shipped with batchrun: the Alembic migrations and the example jobs."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def bundled_dir(name: str) -> Path:
    """``migrations`` or ``jobs``: inside the installed wheel, or at the top of a source checkout."""
    packaged = resources.files("batchrun") / name
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / name
