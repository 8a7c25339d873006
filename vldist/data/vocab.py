"""Word vocabulary: tokenisation, encoding of captions to ids, and its JSON file."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)
_WORD = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lower-case words and numbers; punctuation is dropped (as the VSE++ and VSRN vocabularies do)."""
    return _WORD.findall(text.lower())


class Vocab:
    """Maps words to ids. Ids 0-3 are <pad>, <start>, <end>, <unk>, in that order."""

    def __init__(self, words: Iterable[str]):
        self.itos = list(SPECIALS) + [w for w in words if w not in SPECIALS]
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    pad_id, start_id, end_id, unk_id = 0, 1, 2, 3

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str, max_len: int | None = None) -> list[int]:
        """`<start> words... <end>`, truncated so that the whole fits in `max_len` ids."""
        ids = [self.stoi.get(w, self.unk_id) for w in tokenize(text)]
        if max_len is not None:
            ids = ids[: max(max_len - 2, 0)]
        return [self.start_id, *ids, self.end_id]

    def decode(self, ids: Iterable[int]) -> str:
        words = []
        for i in ids:
            i = int(i)
            if i == self.end_id:
                break
            if i in (self.pad_id, self.start_id):
                continue
            words.append(self.itos[i] if 0 <= i < len(self.itos) else UNK)
        return " ".join(words)

    @classmethod
    def build(cls, captions: Iterable[str], min_count: int = 1) -> Vocab:
        """Words seen at least `min_count` times, most frequent first (ties alphabetical)."""
        counts = Counter(w for c in captions for w in tokenize(c))
        kept = sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))
        return cls(kept)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"words": self.itos[len(SPECIALS) :]}, indent=0) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Vocab:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ValueError(
                f"cannot read the vocabulary {path}: {err}. Delete it and it is rebuilt from the train captions."
            ) from err
        return cls.from_json(text, str(path))

    @classmethod
    def from_json(cls, text: str, where: str) -> Vocab:
        """A vocabulary from vocab.json's text (`where`: where it was read, for the message)."""
        try:
            words = json.loads(text)["words"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"cannot read the vocabulary {where}: {err}. Delete it and it is rebuilt from the train captions."
            ) from err
        return cls(words)
