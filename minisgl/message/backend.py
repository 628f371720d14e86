"""Messages into the scheduler (sent by the tokenizer worker).

UserMsg creates a request's scheduler state; AbortBackendMsg removes it (or one of its
choices) wherever it is;
StateQueryMsg asks for the live counts shown by /debug/lifecycle. (Nothing stops the loop
by message: the launcher terminates the process, or the process sees its parent gone.)
"""

from __future__ import annotations

import msgspec

from minisgl.core import SamplingParams
from minisgl.utils.codec import pack_ids, unpack_ids


class UserMsg(msgspec.Struct, tag=True):
    uid: int
    input_ids_packed: bytes  # int32 array, see codec.pack_ids
    sampling_params: SamplingParams
    # llguidance's grammar for the params' json_schema or grammar, compiled and checked by
    # a grammar-compile process (minisgl/grammar/): the scheduler only builds a matcher
    grammar: str | None = None
    client: str = ""  # who sent it (the TokenizeMsg's `client`)

    @classmethod
    def make(
        cls,
        uid: int,
        input_ids: list[int],
        params: SamplingParams,
        grammar: str | None = None,
        client: str = "",
    ) -> UserMsg:
        return cls(uid, pack_ids(input_ids), params, grammar, client)

    @property
    def input_ids(self) -> list[int]:
        return unpack_ids(self.input_ids_packed)


class AbortBackendMsg(msgspec.Struct, tag=True):
    uid: int
    index: int | None = None  # one choice (a stop string ended it), or None: all of them


class StateQueryMsg(msgspec.Struct, tag=True):
    query_id: int
    flush_cache: bool = False  # empty the prefix cache first, if no request is in flight


BackendMsg = UserMsg | AbortBackendMsg | StateQueryMsg
