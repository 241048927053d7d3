"""What every layer may need to know about a micro-batch besides its activations: each token's
position and the document it belongs to (packed documents).

``AttentionInputs`` is built once per micro-batch from the tokens (``engine.data.packing``) and handed
to every block as ``block(x, inputs)``. Every tensor keeps the sequence as an explicit dimension 1,
so a context-parallel rank's shard of the metadata is ``inputs.select(index)`` (the positions it
holds, which keeps the whole sequence's documents that attention under CP needs);
``inputs.narrow(start, length)`` is a contiguous slice for other uses, refused by CP attention.

Conventions, for a row of tokens ``[a a a E b b E c]`` (E the end-of-document token, which belongs to
the document it ends):

- ``position_ids`` (b, s) int64: the position of each token, ``[0 1 2 3 0 1 2 0]`` with positions
  reset per document, else ``[0 .. s-1]``; a shard keeps the global positions of its tokens.
- ``document_ids`` (b, s) int32 or None: ``[0 0 0 0 1 1 1 2]``, non-decreasing along a row; query i
  may attend to key j only when both carry the same id (and j <= i). None: one document per row.
- ``cu_seqlens``: host ints, the cumulative lengths of the segments of the flattened (b * s) tokens,
  with a leading 0: every document piece of every row, rows in order. For the example row (b = 1)
  ``(0, 4, 7, 8)``. This is what varlen kernels take (npu_fusion_attention's TND layout, CUDA varlen
  attention); it is None when ``document_ids`` is None.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.documents import check_cu_seqlens, check_document_ids, cu_seqlens_from_document_ids
from parallel.runtime.streams import to_device

__all__ = ["AttentionInputs", "cu_seqlens_from_document_ids"]


@dataclass(frozen=True)
class AttentionInputs:
    """Per-token positions and document membership of one micro-batch (see the module docstring)."""
    position_ids: torch.Tensor                   # (b, s) int64
    document_ids: torch.Tensor | None = None     # (b, s) int32
    cu_seqlens: tuple[int, ...] | None = None    # (num_segments + 1,) host ints, leading 0
    whole: "AttentionInputs | None" = None       # a CP shard's unsharded rows (see select)

    def __post_init__(self) -> None:
        if self.position_ids.dim() != 2:
            raise ValueError(f"position_ids must be (b, s), got shape {tuple(self.position_ids.shape)}")
        if self.document_ids is not None:
            if self.document_ids.shape != self.position_ids.shape:
                raise ValueError(f"document_ids {tuple(self.document_ids.shape)} and position_ids "
                                 f"{tuple(self.position_ids.shape)} must have the same (b, s) shape")
            if self.cu_seqlens is None:
                raise ValueError("document_ids need cu_seqlens: build both with "
                                 "cu_seqlens_from_document_ids")
            b, s = self.position_ids.shape
            check_cu_seqlens(self.cu_seqlens, b, s)  # host ints
            if self.document_ids.device.type == "cpu":  # ids on the host already: no device wait
                check_document_ids(self.document_ids)
        elif self.cu_seqlens is not None:
            raise ValueError("cu_seqlens without document_ids: pass both or neither")

    @property
    def packed(self) -> bool:
        """Whether attention is restricted to documents (block-diagonal causal)."""
        return self.document_ids is not None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.position_ids.shape)

    def to(self, device: torch.device | str) -> "AttentionInputs":
        """On ``device``, each tensor copied without a host wait (``streams.to_device``)."""
        doc = to_device(self.document_ids, device) if self.document_ids is not None else None
        whole = self.whole.to(device) if self.whole is not None else None
        return AttentionInputs(to_device(self.position_ids, device), doc, self.cu_seqlens, whole)

    def select(self, index: torch.Tensor) -> "AttentionInputs":
        """The metadata of tokens ``index`` (1-D, increasing) of every row: a context-parallel shard
        (e.g. the load-balanced chunks r and 2cp-1-r). Positions stay global; the segments are those
        of the shard, a segment also ending where ``index`` jumps (a document cut by another rank's
        chunk is two pieces); ``whole`` keeps the unsharded rows."""
        whole = self.whole if self.whole is not None else self
        index = index.to(self.position_ids.device)
        pos = self.position_ids.index_select(1, index)
        if self.document_ids is None:
            return AttentionInputs(pos, whole=whole)
        doc = self.document_ids.index_select(1, index)
        idx = index.detach().cpu()
        ids = doc.detach().cpu()
        ends = torch.ones(ids.shape, dtype=torch.bool)  # True where a token ends its segment
        ends[:, :-1] = (ids[:, 1:] != ids[:, :-1]) | (idx[1:] != idx[:-1] + 1)
        cu = (0, *(torch.nonzero(ends.reshape(-1)).flatten() + 1).tolist())
        return AttentionInputs(pos, doc, cu, whole)

    def narrow(self, start: int, length: int) -> "AttentionInputs":
        """The metadata of tokens [start, start + length) of every row (a sequence shard): global
        positions are kept, the segments are recomputed for the shard (on the host)."""
        pos = self.position_ids.narrow(1, start, length)
        if self.document_ids is None:
            return AttentionInputs(pos)
        doc = self.document_ids.narrow(1, start, length)
        return AttentionInputs(pos, doc, cu_seqlens_from_document_ids(doc))
