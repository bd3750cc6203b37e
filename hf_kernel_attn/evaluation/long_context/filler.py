"""The natural filler text of ``niah`` and ``position_loss``: tokenised once, with its sentence starts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload


class TokenizedText(Sequence[int]):
    """The token ids of a text (a sequence of ints: ``len``, indexing and slicing give the ids) that also knows
    where its sentences start (:meth:`is_boundary`), so a task can put a needle between two sentences."""

    def __init__(self, tokenizer: Any, text: str) -> None:
        self.ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids
        pieces = {i: tokenizer.decode([i]) for i in set(self.ids)}
        self._ends = [pieces[i].rstrip().endswith((".", "!", "?")) for i in self.ids]
        self._starts = [pieces[i][:1] in (" ", "\n") for i in self.ids]

    def is_boundary(self, i: int) -> bool:
        """A sentence starts at token i: token i - 1 ends one, token i begins with a space or newline."""
        return 0 < i < len(self.ids) and self._ends[i - 1] and self._starts[i]

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self.ids[index]
