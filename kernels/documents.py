"""Packed documents' two descriptions and their checks, on the host: per-token ``document_ids``
(b, s), non-decreasing along a row, and ``cu_seqlens``, host ints with a leading 0, the cumulative
lengths of the document pieces of the flattened b * s tokens (every row end a boundary), which
varlen kernels take. kernels/attention.py uses them; models/batch.py builds them per micro-batch.

The checks run where the values are on the host already (never a device wait): a piece across a
row end, or an id that decreases, would make the mask path (ids) and the varlen paths (segments)
attend over different documents.
"""

from __future__ import annotations

import torch


def check_document_ids(ids: torch.Tensor) -> None:
    """ValueError unless the (b, s) ids on the host never decrease along a row (a document is one
    run of tokens: the mask path and the varlen paths read the same documents)."""
    down = torch.nonzero(ids[:, 1:] < ids[:, :-1])  # (k, 2): row, token before the drop
    if len(down):
        row, j = down[0].tolist()
        raise ValueError(f"document_ids must be non-decreasing along a row: row {row} goes from "
                         f"{int(ids[row, j])} to {int(ids[row, j + 1])} at token {j + 1}")


def check_cu_seqlens(cu_seqlens, b: int, s: int) -> None:
    """ValueError unless the host ints ``cu_seqlens`` rise strictly from 0 to b * s and hold every
    row end (k * s): a document piece never runs across a row end."""
    cu = [int(c) for c in cu_seqlens]
    if not cu or cu[0] != 0 or cu[-1] != b * s:
        raise ValueError(f"cu_seqlens must run from 0 to b*s = {b * s} with a leading 0, got "
                         f"{cu[0] if cu else None} .. {cu[-1] if cu else None}")
    bad = next((i for i in range(1, len(cu)) if cu[i] <= cu[i - 1]), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must be strictly increasing, got {cu[bad - 1]} then {cu[bad]} "
                         f"at entry {bad}")
    missing = sorted(set(range(s, b * s, s)) - set(cu))
    if missing:
        raise ValueError(f"cu_seqlens must hold every row end (a multiple of s = {s}): a document "
                         f"piece runs across row end {missing[0]}")


def cu_seqlens_from_document_ids(document_ids: torch.Tensor) -> tuple[int, ...]:
    """(b, s) per-token document ids -> cumulative segment ends over the flattened b * s tokens, with
    a leading 0. A segment ends where the id changes along a row and at every row's end. Example:
    rows [[0, 0, 1], [0, 1, 1]] -> (0, 2, 3, 4, 6). Reads the ids on the host (and checks that they
    never decrease along a row)."""
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be (b, s), got shape {tuple(document_ids.shape)}")
    ids = document_ids.detach().cpu()
    check_document_ids(ids)
    ends = torch.ones(ids.shape, dtype=torch.bool)  # True where a token is the last of its segment
    ends[:, :-1] = ids[:, 1:] != ids[:, :-1]
    return (0, *(torch.nonzero(ends.reshape(-1)).flatten() + 1).tolist())


def document_ids_from_cu_seqlens(cu_seqlens, b: int, s: int, device=None) -> torch.Tensor:
    """The inverse on segments: (b, s) int32 ids numbering the segments of the flattened tokens."""
    lengths = torch.tensor(cu_seqlens, dtype=torch.long).diff()  # (num_segments,)
    ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    return ids.view(b, s).to(device)
