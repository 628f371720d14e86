"""Grammar-constrained decoding, the part that never runs in the scheduler's loop or the
tokenizer worker's: compiling what a user sent (a JSON schema, a tool's parameters, a
Lark grammar) into llguidance's grammar, in processes of their own.

- `compile.py`: what one compile does (`compile_item`), the token table it checks against
  (`TokenTable`), and `GrammarError`.
- `pool.py`: `GrammarCompiler`, a small pool of compile processes with a time limit, in
  which a crash or a hang costs only the request that caused it.
- `worker.py`: the compile process itself (`python -m minisgl.grammar.worker`).

The scheduler's side (a matcher per sequence, the logit mask) is `minisgl/engine/grammar.py`.
"""

from .compile import GrammarError, TokenTable, compile_item

__all__ = ["GrammarError", "TokenTable", "compile_item"]
