"""Where the tests find the repository and the shared data (``../shared/data`` beside the repository)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
