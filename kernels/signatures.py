"""Optional keyword arguments of torch functions, probed instead of assumed.

The engine supports torch 2.4 to 2.13, and torch adds keywords over releases:
``F.scaled_dot_product_attention`` takes ``enable_gqa`` from 2.5 on;
``torch.nn.attention.varlen.varlen_attn`` appeared in 2.10 with ``is_causal`` and later took
``window_size`` (causal as (-1, 0)) and ``enable_gqa`` instead. A kernel passes such a keyword only
where the installed function takes it, and otherwise does what the keyword would have done (repeats
the key/value heads, masks causally) or takes another path. Python functions are read with
``inspect.signature``; torch's builtins, which have none, document theirs on the first line of
their docstring (``scaled_dot_product_attention(query, key, value, attn_mask=None, ...) ->
Tensor``), which is read instead.
"""
from __future__ import annotations

import functools
import inspect
import re


@functools.lru_cache(maxsize=None)  # a function's signature does not change
def keyword_names(fn) -> frozenset[str]:
    """The parameter names ``fn`` accepts by keyword (empty when they cannot be read).

    >>> sorted(keyword_names(lambda q, *, scale=None, enable_gqa=False: q))
    ['enable_gqa', 'q', 'scale']
    """
    try:
        params = inspect.signature(fn).parameters
        names = frozenset(n for n, p in params.items()
                          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    except (TypeError, ValueError):  # a builtin: its docstring's first line is its signature
        return _docstring_names(getattr(fn, "__doc__", None) or "")
    return names


def _docstring_names(doc: str) -> frozenset[str]:
    """Names in a ``name(a, b=1, *, c=None) -> T`` line at the top of a docstring.

    >>> sorted(_docstring_names("sdpa(query, key, attn_mask=None,\\n   scale=None) -> Tensor:\\n ..."))
    ['attn_mask', 'key', 'query', 'scale']
    """
    match = re.match(r"\s*[\w.]+\((.*?)\)\s*->", doc, re.S)
    if not match:
        return frozenset()
    names = (part.split("=")[0].split(":")[0].strip() for part in match.group(1).split(","))
    return frozenset(n for n in names if n and n not in ("*", "/") and n.isidentifier())


def accepts(fn, name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name``."""
    return name in keyword_names(fn)
