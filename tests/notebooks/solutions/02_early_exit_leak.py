"""Reference solution of notebook 02's exercise: the reference's manager, cleanup in a
`finally` (which still runs when the generator is closed at its `yield`)."""

from __future__ import annotations

from naive import RefStyleManager


class FinallyManager(RefStyleManager):
    async def wait_for_ack(self, uid: int):
        event = self.event_map[uid]
        try:
            while True:
                await event.wait()
                event.clear()
                pending, self.ack_map[uid] = self.ack_map[uid], []
                for reply in pending:
                    yield reply
                if pending and pending[-1].finished:
                    return
        finally:
            self.ack_map.pop(uid, None)
            self.event_map.pop(uid, None)
