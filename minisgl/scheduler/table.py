"""TableManager: the request slots of the page table.

Contract: a request holds one slot (a row of the engine's page table) from its first
prefill chunk until it finishes, is aborted or is preempted; `free` gives the slot back.
`used` is what /debug/lifecycle reports as table_slots_used.
"""

from __future__ import annotations


class TableManager:
    def __init__(self, max_running_requests: int) -> None:
        self.size = max_running_requests
        self._free = list(range(max_running_requests - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.size - len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"table slot {slot} freed twice")
        self._free.append(slot)
