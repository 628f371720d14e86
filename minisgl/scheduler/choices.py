"""The n choices of one request: sequences that share the pages of its prompt.

Contract: a request with `n` choices is admitted as one sequence, its first choice, which
carries `forks_left = n - 1`; once its prompt is cached, `fork_choices(first, cache,
seed_for, copy_matcher)` makes the other choices, each sharing the cached prompt's pages
(`CacheManager.share`) and waiting to be scheduled. Each recomputes only the page that
holds the prompt's last token (at most page_size tokens, into a page of its own: that
position's output is what the choice samples its first token from), then decodes on its
own, with its own seed (`seed_for(params, index)`) and, under a constraint, a twin of the
first choice's matcher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minisgl.core import Req, SamplingParams

from .cache import CacheManager


# --8<-- [start:fork]
def fork_choices(
    first: Req,
    cache: CacheManager,
    seed_for: Callable[[SamplingParams, int], int],
    copy_matcher: Callable[[Any], Any],
) -> list[Req]:
    shared = (first.prompt_len - 1) // cache.page_size  # whole pages before the last token
    children = []
    for index in range(1, first.forks_left + 1):
        child = Req(
            uid=first.uid,
            token_ids=first.token_ids[: first.prompt_len],
            prompt_len=first.prompt_len,
            max_len=first.max_len,
            sampling_params=first.sampling_params,
            seed=seed_for(first.sampling_params, index),
            eos_token_ids=first.eos_token_ids,
            index=index,
            client=first.client,
            # the first choice's matcher has consumed nothing yet: its first token is
            # being sampled in the step that forks
            matcher=first.matcher and copy_matcher(first.matcher),
        )
        cache.share(first, child, shared)
        child.cached_len = shared * cache.page_size
        children.append(child)
    return children


# --8<-- [end:fork]
