"""FairShares: the API server's request slots, shared fairly between clients.

Contract: `FairShares(limit)` holds the --max-concurrent-requests slots. A client is its API
key (a digest of it, under --api-key) or else its address. `refusal(client)` is why a new
request of `client` may not start now, or None: the server is full, or this client already
holds its share while another client waits. `take(uid, client)` and `give_back(uid)` count
a request's slot from its admission to the end of its scope.

The rule (max-min fairness over the clients that want slots): a client that was refused
within the last WAITING_S seconds is waiting, even once a retry got in (a client that sends
one request after another finds room for the next); the share of each client is the limit
divided by the number of clients holding slots or waiting. A client at or over its share is refused
while any other client waits, even with slots free: the next freed slot goes to whoever
waits instead of to the client that already holds the most. With nobody waiting, a client
may take every free slot (an idle server serves one busy client fully). Each refusal is a
503 with Retry-After, so the one over its share backs off while the others are served.
"""

from __future__ import annotations

import time
from collections import Counter

from minisgl.message import ErrorInfo, ErrorKind

WAITING_S = 5.0  # a refused client counts as waiting this long: a few Retry-After rounds


class FairShares:
    def __init__(self, limit: int, clock=time.monotonic) -> None:
        self.limit = limit
        self.clock = clock
        self.held: Counter[str] = Counter()  # slots each client holds
        self.client_of: dict[int, str] = {}  # uid -> its client
        self.refused_at: dict[str, float] = {}  # client -> when it was last refused

    def waiting(self, now: float) -> set[str]:
        """Clients refused within WAITING_S (the stale ones are forgotten here)."""
        for client in [c for c, t in self.refused_at.items() if now - t > WAITING_S]:
            del self.refused_at[client]
        return set(self.refused_at)

    def refusal(self, client: str) -> ErrorInfo | None:
        now = self.clock()
        waiting = self.waiting(now) - {client}
        if len(self.client_of) >= self.limit:
            message = f"the server is at its limit of {self.limit} requests in flight"
        elif waiting:
            wanting = {c for c, n in self.held.items() if n} | waiting | {client}
            share = max(1, self.limit // len(wanting))
            if self.held[client] < share:
                return None
            message = (
                f"this client holds {self.held[client]} of the {self.limit} requests in "
                f"flight, its share while {len(wanting) - 1} other client(s) want some"
            )
        else:
            return None
        self.refused_at[client] = now
        return ErrorInfo(ErrorKind.OVERLOADED, message + "; retry shortly")

    def take(self, uid: int, client: str) -> None:
        self.client_of[uid] = client
        self.held[client] += 1  # (a refused client stays waiting: its next ask finds room)

    def give_back(self, uid: int) -> None:
        client = self.client_of.pop(uid)
        self.held[client] -= 1
        if not self.held[client]:
            del self.held[client]
