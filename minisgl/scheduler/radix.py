"""RadixCache: the prefixes whose KV pages are kept for reuse, as a tree of token pages.

Contract: each node of the tree is one KV page. Its key is the `page_size` token ids whose
K/V the page holds, its parent the page before it in the sequence, the root the empty
prefix; so every path from the root spells a prefix (a whole number of pages) and lists the
pages that hold its K/V.
- `match(tokens, max_pages)`: the pages of the longest cached prefix of `tokens`, at most
  `max_pages` of them.
- `insert(tokens, pages)`: adds a sequence's full pages (page i holds tokens
  [i * page_size, (i + 1) * page_size)) and returns the pages the tree did not hold before.
  Where a prefix is cached already under other pages (two requests computed it at the same
  time), the tree keeps its own pages and the new ones that follow hang under them.
- `remove(page)`: takes the page's node out with everything under it (nothing could reach
  a descendant once its prefix is gone) and returns their pages.
- `page in tree`, `len(tree)` (nodes, i.e. pages held), `clear()`.
- A `salt` (match and insert take one) partitions the tree: the first page's key carries
  it, so prefixes cached under one salt are never found under another (tenants that must
  not learn each other's prompts from `cached_tokens` or timing). None is a salt too, the
  one requests without a salt share.

It is a radix tree whose edges are whole pages: SGLang's tree splits an edge at any token,
but only whole pages can be shared, so a page per node is all that matching can use. The
tree knows nothing of who else holds a page or what to evict first: reference counts and
the least-recently-used order are the cache manager's (cache.py).
"""

from __future__ import annotations

from collections.abc import Sequence


class _Node:
    __slots__ = ("page", "key", "parent", "children")

    def __init__(self, page: int, key: tuple[int, ...], parent: _Node | None) -> None:
        self.page, self.key, self.parent = page, key, parent
        self.children: dict[tuple[int, ...], _Node] = {}


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = _Node(-1, (), None)
        self._nodes: dict[int, _Node] = {}  # page -> its node

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, page: int) -> bool:
        return page in self._nodes

    def _key(self, tokens: Sequence[int], i: int, salt: str | None = None) -> tuple:
        key = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
        return (salt, *key) if i == 0 and salt is not None else key

    # --8<-- [start:match]
    def match(self, tokens: Sequence[int], max_pages: int, salt: str | None = None) -> list[int]:
        """The pages of the longest cached prefix of `tokens` (at most `max_pages`)."""
        node, pages = self.root, []
        for i in range(min(max_pages, len(tokens) // self.page_size)):
            node = node.children.get(self._key(tokens, i, salt))
            if node is None:
                break
            pages.append(node.page)
        return pages

    # --8<-- [end:match]

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], salt: str | None = None
    ) -> list[int]:
        """Cache the prefix `tokens[:len(pages) * page_size]` held by `pages`; returns the
        pages newly held by the tree."""
        assert len(tokens) >= len(pages) * self.page_size, "a page holds a full key"
        node, added = self.root, []
        for i, page in enumerate(pages):
            key = self._key(tokens, i, salt)
            child = node.children.get(key)
            if child is None:
                if page in self._nodes:  # a page is the K/V of one prefix: never two nodes
                    raise ValueError(f"page {page} is cached under another prefix")
                child = node.children[key] = _Node(page, key, node)
                self._nodes[page] = child
                added.append(page)
            node = child  # an existing node keeps its page; the sequence's copy stays its own
        return added

    def remove(self, page: int) -> list[int]:
        """Take `page`'s node and its whole subtree out; their pages, the node's first."""
        node = self._nodes[page]
        del node.parent.children[node.key]
        removed, stack = [], [node]
        while stack:
            node = stack.pop()
            removed.append(node.page)
            del self._nodes[node.page]
            stack.extend(node.children.values())
        return removed

    def clear(self) -> list[int]:
        """Empty the tree; the pages it held."""
        pages = list(self._nodes)
        self.root.children.clear()
        self._nodes.clear()
        return pages
