"""Packed documents: per-micro-batch metadata built from the tokens alone (Megatron-LM's
``--reset-attention-mask``, ``--reset-position-ids`` and ``--eod-mask-loss``).

A sample is a window of the token stream, so it holds the end of one document, whole documents and
the start of the next, separated by the end-of-document token E. The E token belongs to the document
it ends. For inputs ``[a a a E b b E c]``:

- reset attention mask: per-token document ids ``[0 0 0 0 1 1 1 2]``, attention stays inside a
  document (block-diagonal causal), and the varlen segments of the flattened batch;
- reset position ids: positions ``[0 1 2 3 0 1 2 0]``, restarting after every E;
- eod mask loss: loss mask ``[1 1 1 0 1 1 0 1]``: the loss is dropped where the INPUT is E, whose
  target is the first token of the next document, a prediction no document alone makes (Megatron's
  rule). The prediction of E itself (``a -> E``) is kept: it teaches the model to end documents.

Everything here is a pure function of the tokens, so every pipeline stage builds the same metadata
from the micro-batch it loads, and nothing extra travels between stages. The loss is the mean over
the unmasked tokens of the whole global batch: ``count_loss_tokens`` counts them from the sampler's
indices of the global batch (a function of (seed, step)), identically on every rank, with no
collective: for prepared data by looking them up in a per-sample table the dataset builds once
(no sample read per step).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from models.batch import AttentionInputs, cu_seqlens_from_document_ids
from parallel.runtime.streams import to_device


@dataclass(frozen=True)
class PackingConfig:
    """Which of Megatron's packed-document switches are on, and the boundary token."""
    eod_id: int | None
    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False

    def __post_init__(self) -> None:
        if self.eod_id is None and (self.reset_attention_mask or self.reset_position_ids
                                    or self.eod_mask_loss):
            raise ValueError("--reset-attention-mask, --reset-position-ids and --eod-mask-loss need "
                             "data with an end-of-document token; this data has none")

    @property
    def needs_inputs(self) -> bool:
        """Whether the model needs per-token metadata (positions or documents)."""
        return self.reset_attention_mask or self.reset_position_ids


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the step consumes it."""
    tokens: torch.Tensor                       # (b, s) inputs
    labels: torch.Tensor                       # (b, s) targets (inputs shifted by one)
    inputs: AttentionInputs | None = None      # per-token positions / documents; None: plain causal
    loss_mask: torch.Tensor | None = None      # (b, s) float, 1 where the loss counts
    loss_tokens: int | None = None             # unmasked tokens of the whole GLOBAL batch

    def select(self, index: torch.Tensor) -> "MicroBatch":
        """The tokens ``index`` (1-D, increasing) of every row: a context-parallel shard of tokens,
        labels, loss mask and metadata (global positions, the whole rows kept for attention).
        ``loss_tokens`` stays the global batch's count."""
        pick = lambda t: None if t is None else t.index_select(1, index.to(t.device))
        return MicroBatch(pick(self.tokens), pick(self.labels),
                          self.inputs.select(index) if self.inputs is not None else None,
                          pick(self.loss_mask), self.loss_tokens)

    def to(self, device) -> "MicroBatch":
        """On ``device``, each tensor copied without a host wait (``streams.to_device``)."""
        move = lambda t: None if t is None else to_device(t, device)  # noqa: E731
        return MicroBatch(move(self.tokens), move(self.labels),
                          self.inputs.to(device) if self.inputs is not None else None,
                          move(self.loss_mask), self.loss_tokens)


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """(b, s) int32: how many E tokens precede each token in its row (E belongs to its document)."""
    is_eod = (tokens == eod_id).to(torch.int32)  # (b, s)
    return (torch.cumsum(is_eod, dim=1) - is_eod).to(torch.int32)


def position_ids(tokens: torch.Tensor, eod_id: int | None, reset: bool) -> torch.Tensor:
    """(b, s) int64 positions: 0..s-1, or (reset) restarting at 0 after every E."""
    b, s = tokens.shape
    pos = torch.arange(s, dtype=torch.long, device=tokens.device).expand(b, s)
    if not reset:
        return pos.contiguous()
    first = torch.ones(b, s, dtype=torch.bool, device=tokens.device)  # first token of a document
    first[:, 1:] = tokens[:, :-1] == eod_id
    starts = torch.where(first, pos, 0).cummax(dim=1).values  # (b, s) each token's document start
    return pos - starts


def loss_mask(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """(b, s) float: 0 where the input token is E (its target starts the next document), else 1."""
    return (tokens != eod_id).to(torch.float32)


def attention_inputs(tokens: torch.Tensor, cfg: PackingConfig) -> AttentionInputs | None:
    """The model's per-token metadata for ``tokens`` (b, s), or None when no switch needs it."""
    if not cfg.needs_inputs:
        return None
    pos = position_ids(tokens, cfg.eod_id, cfg.reset_position_ids)
    if not cfg.reset_attention_mask:
        return AttentionInputs(pos)
    docs = document_ids(tokens, cfg.eod_id)
    return AttentionInputs(pos, docs, cu_seqlens_from_document_ids(docs))


def count_loss_tokens(dataset, indices: Iterable[int], eod_id: int) -> int:
    """Unmasked input tokens (not E) over the samples ``indices`` of ``dataset`` (each (s+1,)):
    a sum over the dataset's per-sample table where it keeps one (``loss_tokens``: prepared
    corpora and their blends, no sample read from disk), else by reading the samples (mock data,
    generated on demand)."""
    if hasattr(dataset, "loss_tokens"):
        return dataset.loss_tokens(indices, eod_id)
    return sum(int((dataset[int(i)][:-1] != eod_id).sum()) for i in indices)


def micro_batch(sample: torch.Tensor, cfg: PackingConfig | None,
                loss_tokens: int | None = None) -> MicroBatch:
    """Split collated samples (b, s+1) into inputs and labels and add the metadata ``cfg`` asks for;
    ``loss_tokens`` is the global batch's unmasked token count (with --eod-mask-loss)."""
    tokens, labels = sample[:, :-1].contiguous(), sample[:, 1:].contiguous()  # (b, s) each
    if cfg is None:
        return MicroBatch(tokens, labels)
    mask = loss_mask(tokens, cfg.eod_id) if cfg.eod_mask_loss else None
    return MicroBatch(tokens, labels, attention_inputs(tokens, cfg), mask,
                      loss_tokens if cfg.eod_mask_loss else None)
