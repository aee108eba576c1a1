"""The engine hash → key cache in two dicts: the oracle of the compiled ``native.KeyCache``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KeyCache:
    """Recent engine hash → key mappings of one stream, in two generations: ``young`` becomes
    ``old`` when half full, the previous ``old`` dropped whole; a hit in ``old`` moves back."""

    capacity: int
    young: dict[int, int] = field(default_factory=dict)
    old: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.young)

    def get(self, engine_hash: int) -> int | None:
        key = self.young.get(engine_hash)
        if key is None:
            key = self.old.get(engine_hash)
            if key is not None:
                self.young[engine_hash] = key
        return key

    def put(self, engine_hash: int, key: int) -> None:
        self.young[engine_hash] = key

    def age(self) -> None:
        if len(self.young) >= self.capacity // 2:
            self.old = self.young
            self.young = {}
