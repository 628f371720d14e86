"""FairShares (server/shares.py): the request slots shared between clients. Alone, a client
may take every slot; once another client has been refused, a client at its share is refused
(even with slots free) until the other has had its turn, and the one that waited stays
counted for its next request; a waiting client stops counting after WAITING_S; the limit
holds whoever asks."""

from __future__ import annotations

from minisgl.message import ErrorKind
from minisgl.server.shares import WAITING_S, FairShares


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_alone_a_client_takes_every_slot_and_the_limit_holds():
    shares = FairShares(4, Clock())
    for uid in range(4):
        assert shares.refusal("a") is None
        shares.take(uid, "a")
    refused = shares.refusal("a")
    assert refused.kind is ErrorKind.OVERLOADED and "limit of 4" in refused.message
    assert shares.refusal("b").kind is ErrorKind.OVERLOADED


def test_a_freed_slot_goes_to_the_waiting_client_not_to_the_one_holding_the_most():
    clock = Clock()
    shares = FairShares(4, clock)
    for uid in range(4):
        shares.take(uid, "storm")
    assert shares.refusal("polite") is not None  # full: polite now waits
    shares.give_back(0)  # a slot frees
    refused = shares.refusal("storm")  # 3 held, share 4 // 2 = 2: over it while polite waits
    assert refused.kind is ErrorKind.OVERLOADED and "its share" in refused.message
    assert shares.refusal("polite") is None  # polite's retry gets the slot
    shares.take(10, "polite")
    shares.give_back(10)  # polite's answer is done; it asks again at once
    shares.give_back(1)  # a storm slot frees: storm (2 held) stays at its share of 2 ...
    assert shares.refusal("storm") is not None
    assert shares.refusal("polite") is None  # ... so polite's next request finds room
    shares.take(11, "polite")
    shares.give_back(2)  # storm down to 1: under its share again
    assert shares.refusal("storm") is None
    shares.take(12, "storm")
    assert shares.held == {"storm": 2, "polite": 1}


def test_a_refused_client_stops_waiting_after_a_while():
    clock = Clock()
    shares = FairShares(2, clock)
    shares.take(0, "a")
    shares.take(1, "a")
    assert shares.refusal("b") is not None  # b waits
    shares.give_back(1)
    assert shares.refusal("a") is not None  # a holds its share (1 of 2) while b waits
    clock.now += WAITING_S + 0.1  # b never came back
    assert shares.refusal("a") is None
    shares.give_back(0)
    assert shares.held == {} and shares.client_of == {}
