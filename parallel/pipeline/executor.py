"""One executor for every pipeline schedule.

``run_schedule`` walks this rank's action list: compute actions call the model through
``forward_step`` and autograd, each run of consecutive transfers is one batch (or several, at most
one send to and one receive from each peer in each: actions.py ``batches``), posted at once and
waited for where a compute step needs it (exchange.py). The model side is one callback, so a GPT
(or any stack of modules) plugs in without the executor knowing its layers::

    lists = build_schedule("1f1b", ps.pp_size, num_microbatches)
    def forward_step(chunk, micro, x):             # x is None on virtual stage 0
        h = model_chunks[chunk](tokens[micro] if x is None else x)
        return loss_fn(h, labels[micro]) / num_microbatches if last_chunk else h
    result = run_schedule(ps, lists, model_chunks, forward_step, num_microbatches,
                          tensor_shape=(seq, micro_batch, hidden), dtype=torch.float32,
                          timeout_s=60)
    sum_embedding_grads(ps, tied_params)           # then DP reduction and the optimizer step

Timing: every action is bracketed by two stamps of ``clock`` on the device's stream (events on
CUDA/NPU, ``engine.device.clock.DeviceClock``), so a span is the device's time for that action, and the
time in a transfer is how long the stream waited for it. Stamps become ``TimelineEvent``s in wall
seconds only when ``PipelineResult.events`` is first read (after the step, so reading them does not
stall the device in the middle of it). On CPU without a clock, ``time.perf_counter`` stamps are
the device's: CPU operations run synchronously. Transfers are stamped twice over: each batch's
post and each wait are also kept as ``PipelineResult.spans`` naming the program indices they
cover, from which transfers.py finds the exposed transfer time and the replay's transfer costs.

Memory: once an output activation has been sent, only its autograd graph is needed, so its storage
is replaced by a one-element tensor (Megatron's ``deallocate_output_tensor``); its backward then
runs through the autograd engine directly, since ``torch.autograd.backward`` checks the output's
shape. An output that is a view (a custom block ending in ``.view``/``.transpose``) is stored as a
copy first (``_freeable``), or its base would stay alive through the view until the backward.
Forward-only (validation) runs keep nothing past its use: a received input is dropped after its
forward, an output once its send is posted (the posted transfer keeps the sent buffer until the
send completes) or once the next chunk on this rank has taken it (the V's turn), and the last
stage keeps only the loss.

Zero-bubble schedules: a ``B`` runs the backward inside ``weight_grads.capture((micro, chunk))``
(``parallel.grads.weight_grad.WeightGradStore``), so the layers queue their weight gradients instead
of computing them, and the ``W`` of the same (micro-batch, chunk) runs them. Without a store (or for
layers outside the split) the weight gradients are computed in B and W has nothing to do. A
micro-batch's activations count as in flight until its W. A stage boundary inside one rank (the V
placement's turn on rank pp-1) needs no transfer: the later stage's F takes the earlier stage's
output directly, and its B hands the input gradient straight to the earlier stage's B.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.autograd import Variable

from parallel.grads.main_grad import all_reduce_grads_, reduced_grad
from parallel.pipeline.actions import batches, has_weight_actions, neighbour, placement_of
from parallel.pipeline.exchange import Exchange, Split
from parallel.pipeline.p2p import Transfer
from parallel.pipeline.schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action
from parallel.pipeline.result import HostClock, PipelineResult  # noqa: F401 (re-exported)
from parallel.pipeline.timeline import TimelineEvent

PipelineEvent = TimelineEvent
ShapeSpec = Sequence[int] | Callable[[int, int], Sequence[int]]


def _free_output(out: torch.Tensor) -> bool:
    """Drop an output's storage when only its graph is still needed (not for views or leaves)."""
    if out._base is not None or out.grad_fn is None or out.numel() <= 1:
        return False
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)
    return True


def _freeable(out: torch.Tensor) -> torch.Tensor:
    """A view with a graph as a tensor of its own (its gradient flows through the copy unchanged),
    so that ``_free_output`` can drop its storage after the send; anything else as it is."""
    if out._base is None or out.grad_fn is None:
        return out
    return out.clone(memory_format=torch.contiguous_format)


def _backward(out: torch.Tensor, grad: torch.Tensor | None, freed: bool) -> None:
    if not freed:
        torch.autograd.backward(out, grad_tensors=grad)
        return
    # The output's data is a placeholder: skip autograd.backward's shape check (as Megatron does).
    Variable._execution_engine.run_backward(
        tensors=(out,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


class _RankRun:
    """The state of one rank's step: tensors keyed by (micro-batch, chunk)."""

    def __init__(self, ps, chunks, forward_step, num_microbatches, tensor_shape, dtype, timeout_s,
                 clock, deallocate_outputs, waiter=None, placement="loop", weight_grads=None,
                 split_w=False, scatter_gather=False, forward_only=False):
        self.ps, self.vp, self.forward_step = ps, len(chunks), forward_step
        self.forward_only = forward_only
        self.m, self.shape, self.dtype = num_microbatches, tensor_shape, dtype
        self.clock, self.deallocate = clock, deallocate_outputs
        self.placement, self.weight_grads, self.split_w = placement, weight_grads, split_w
        self.exchange = Exchange(ps, timeout_s, len(chunks), waiter)
        self.split = Split(ps, scatter_gather)
        self.inputs: dict = {}        # input activations (leaves with requires_grad)
        self.outputs: dict = {}       # (output tensor, freed?) awaiting backward (forward-only:
                                      # awaiting its send, or the next chunk here: the V's turn)
        self.out_meta: dict = {}      # (shape, dtype) of each output, for the gradient buffer
        self.grad_out: dict = {}      # gradients of outputs (received, or from a stage on this rank)
        self.grad_in: dict = {}       # gradients of inputs awaiting their send
        self.losses: dict[int, torch.Tensor] = {}
        self.marks: list = []  # (name, cat, start stamp, end stamp, micro, chunk)
        self.spans: list = []  # transfers: (post | wait, start stamp, end stamp, action indices)
        self.recv_at: dict = {}        # consumer key -> index of its receive in the program
        self.batch_at: dict = {}       # id(posted batch) -> program indices of its transfers
        self.live = self.peak = 0

    # ---- helpers ------------------------------------------------------------------------------
    def now(self):
        return self.clock.stamp()

    def other(self, chunk: int, step: int) -> tuple[int, int] | None:
        """(pp rank, chunk) of the virtual stage ``step`` away from this rank's ``chunk``."""
        return neighbour(self.ps.pp_rank, chunk, self.ps.pp_size, self.vp, self.placement, step)

    def is_last(self, chunk: int) -> bool:
        return self.other(chunk, +1) is None

    def local(self, chunk: int, step: int) -> int | None:
        """The chunk of this rank that runs the stage ``step`` away, if that stage is here."""
        other = self.other(chunk, step)
        return other[1] if other is not None and other[0] == self.ps.pp_rank else None

    def record(self, name, cat, start, micro=-1, chunk=0) -> None:
        self.marks.append((name, cat, start, self.now(), micro, chunk))

    def input_shape(self, chunk: int, micro: int) -> tuple[int, ...]:
        shape = self.shape(chunk, micro) if callable(self.shape) else self.shape
        return tuple(int(s) for s in shape)

    def await_inputs(self, kind: str, micro: int, chunk: int) -> None:
        """Wait for the received tensor this compute step consumes, if it is still in flight."""
        key = (kind, micro, chunk)
        if self.exchange.needs(key):
            start = self.now()
            self.exchange.wait_for([key])
            self.record(f"wait {kind.upper()}{micro}.{chunk}", "comm", start, micro, chunk)
            self.spans.append(("wait", start, self.marks[-1][3], (self.recv_at.pop(key),)))

    # ---- compute ------------------------------------------------------------------------------
    def forward(self, micro: int, chunk: int) -> None:
        self.await_inputs("f", micro, chunk)
        key = (micro, chunk)
        before = self.local(chunk, -1)
        if before is not None:          # the previous stage runs here: take its output directly
            out, _ = self._handed_on((micro, before)) if self.forward_only \
                else self.outputs[(micro, before)]
            self.inputs[key] = out.detach().requires_grad_()
        # forward-only: nothing keeps the input past this forward (training: kept for backward)
        x = self.inputs.pop(key, None) if self.forward_only else self.inputs.get(key)
        if x is None and self.other(chunk, -1) is not None:
            raise RuntimeError(f"pipeline stage {self.ps.pp_rank}: forward of micro-batch {micro} "
                               f"chunk {chunk} runs before its input arrived (schedule bug)")
        start = self.now()
        out = self.forward_step(chunk, micro, x)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"forward_step must return a tensor, got {type(out).__name__}")
        if self.is_last(chunk):
            if out.numel() != 1:
                raise ValueError(f"forward_step on the last stage must return the scalar loss "
                                 f"(already divided by num_microbatches), got shape "
                                 f"{tuple(out.shape)}")
            self.losses[micro] = out.detach().reshape(())
        self.live += 1
        self.peak = max(self.peak, self.live)
        if self.forward_only:
            if self.is_last(chunk):     # the loss is kept, not the output
                self.live -= 1
            else:
                self.outputs[key] = (out, False)
        else:
            if self.deallocate and self.local(chunk, +1) is None and not self.is_last(chunk):
                out = _freeable(out)    # sent, then freed: a view would keep its base alive
            self.outputs[key] = (out, False)
            self.out_meta[key] = (tuple(out.shape), out.dtype)
        self.record(f"F{micro}.{chunk}", "forward", start, micro, chunk)

    def backward(self, micro: int, chunk: int) -> None:
        self.await_inputs("b", micro, chunk)
        start = self.now()
        out, freed = self.outputs.pop((micro, chunk))
        grad = None if self.is_last(chunk) else self.grad_out.pop((micro, chunk))
        if self.split_w and self.weight_grads is not None:
            with self.weight_grads.capture((micro, chunk)):
                _backward(out, grad, freed)
        else:
            _backward(out, grad, freed)
        x = self.inputs.pop((micro, chunk), None)
        if x is not None:
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            before = self.local(chunk, -1)
            if before is not None:      # the previous stage runs here: its output's gradient
                self.grad_out[(micro, before)] = g
            else:
                self.grad_in[(micro, chunk)] = g.contiguous()
        self.out_meta.pop((micro, chunk), None)
        if not self.split_w:
            self.live -= 1
        self.record(f"B{micro}.{chunk}", "backward", start, micro, chunk)

    def weight(self, micro: int, chunk: int) -> None:
        start = self.now()
        if self.weight_grads is not None:
            self.weight_grads.run((micro, chunk))
        self.live -= 1
        self.record(f"W{micro}.{chunk}", "weight", start, micro, chunk)

    # ---- communication ------------------------------------------------------------------------
    def transfer(self, actions: list[Action], then: Action | None, first: int = 0) -> None:
        """Post one batch (``actions``, at index ``first`` of the program); wait at once for what
        ``then`` (the next compute step) consumes."""
        transfers, receives = [], []
        indices = tuple(range(first, first + len(actions)))
        for a in actions:
            key = (a.microbatch, a.chunk)
            step = -1 if a.kind in (RECV_F, SEND_B) else +1
            peer, peer_chunk = self.other(a.chunk, step)
            peer_rank = self.ps.stage_rank(peer)
            if a.kind == RECV_F:
                shape = self.input_shape(a.chunk, a.microbatch)
                buf = self.split.buffer(shape, self.dtype, self.ps.device)
                receives.append((("f",) + key, len(transfers),
                                 lambda got, key=key, shape=shape: self.inputs.__setitem__(
                                     key, self.split.whole(got, shape).requires_grad_())))
                transfers.append(Transfer("recv", buf, peer, peer_rank, "activation",
                                          a.microbatch, peer_chunk))
            elif a.kind == SEND_F:
                out, _ = self.outputs[key]
                transfers.append(Transfer("send", self.split.piece(out.detach()), peer, peer_rank,
                                          "activation", a.microbatch, peer_chunk))
            elif a.kind == RECV_B:
                shape, dtype = self.out_meta[key]
                buf = self.split.buffer(shape, dtype, self.ps.device)
                receives.append((("b",) + key, len(transfers),
                                 lambda got, key=key, shape=shape: self.grad_out.__setitem__(
                                     key, self.split.whole(got, shape))))
                transfers.append(Transfer("recv", buf, peer, peer_rank, "gradient",
                                          a.microbatch, peer_chunk))
            elif a.kind == SEND_B:
                transfers.append(Transfer("send", self.split.piece(self.grad_in.pop(key)), peer,
                                          peer_rank, "gradient", a.microbatch, peer_chunk))
            else:
                raise ValueError(f"not a transfer action: {a!r}")
        for (key, _, _), i in zip(receives, [i for i, a in zip(indices, actions)
                                             if a.kind in (RECV_F, RECV_B)]):
            self.recv_at[key] = i
        start = self.now()
        batch = self.exchange.post(transfers, receives)
        self.batch_at[id(batch)] = indices
        for a in actions:
            if a.kind == SEND_F:
                self._sent_output((a.microbatch, a.chunk))
        self.record("+".join(repr(a) for a in actions), "comm", start)
        posted = self.marks[-1][3]
        self.spans.append(("post", start, posted, indices))
        if then is not None and then.kind in (F, B):
            key = (then.kind.value, then.microbatch, then.chunk)
            if self.exchange.wait_for([key]):
                self.record(f"wait {then.kind.value.upper()}{then.microbatch}.{then.chunk}",
                            "comm", posted, then.microbatch, then.chunk)
                self.spans.append(("wait", posted, self.marks[-1][3], (self.recv_at.pop(key),)))

    def finish(self) -> None:
        start = self.now()
        pending = tuple(self.batch_at[id(batch)][k] for batch, sends in self.exchange.sending
                        for k in sends)
        self.exchange.finish()
        if pending:
            self.record("wait sends", "comm", start)
            self.spans.append(("wait", start, self.marks[-1][3], pending))

    def _sent_output(self, key) -> None:
        if self.forward_only:
            self._handed_on(key)
            return
        out, freed = self.outputs[key]
        if self.deallocate and not freed:
            self.outputs[key] = (out, _free_output(out))

    def _handed_on(self, key) -> tuple[torch.Tensor, bool]:
        """Forward-only: drop an output once its send is posted or the next chunk here takes it."""
        self.live -= 1
        return self.outputs.pop(key)


def run_schedule(ps, actions: Sequence[Action] | Sequence[Sequence[Action]],
                 chunks: Sequence[torch.nn.Module], forward_step: Callable, num_microbatches: int,
                 tensor_shape: ShapeSpec, dtype: torch.dtype, timeout_s: float | None,
                 clock=None, deallocate_outputs: bool = True, forward_only: bool = False,
                 waiter=None, placement: str | None = None, weight_grads=None,
                 scatter_gather: bool = False) -> PipelineResult:
    """Run one step's forwards and backwards on this rank; gradients accumulate in ``.grad``.

    ``actions`` is this rank's list or the whole schedule (this rank's list is taken; a
    ``Schedule`` also gives the chunk placement, otherwise ``placement``, default "loop").
    ``forward_step(chunk, micro, x)`` returns the chunk's output activation, or on the last
    virtual stage the scalar loss already divided by ``num_microbatches``; ``x`` is None on the
    first virtual stage. ``tensor_shape`` is the activation shape between stages, or a
    function ``(chunk, micro) -> shape`` of this rank's chunk input when it varies.
    ``clock`` stamps the device's stream (``engine.device.clock.DeviceClock``, anchored by the caller);
    None is allowed on CPU only, where host stamps are device stamps.
    ``forward_only`` runs a schedule of forwards and activation transfers only
    (``schedules.forward_only_schedule``; validation, under torch.no_grad): each received input is
    dropped after its forward and each output once its send is posted or the next chunk on this
    rank has taken it, the last stage keeps only the loss, so at most the tensors in flight are
    held (``peak_in_flight``: ``replay.forward_only_peaks``); ``deallocate_outputs`` does not
    apply.
    ``waiter``: how transfers are waited for (``p2p.waiter_for(backend)``; default a host wait).
    ``weight_grads``: the ``WeightGradStore`` the chunks' layers are attached to, for schedules
    with W actions. ``scatter_gather``: send 1/tp of each boundary tensor per TP rank and
    all-gather on receipt (exchange.py; only for tensors replicated over TP).
    """
    if actions and not isinstance(actions[0], Action):
        placement = placement or placement_of(actions)
        actions = actions[ps.pp_rank]
    placement = placement or "loop"
    actions = list(actions)
    if not chunks:
        raise ValueError("run_schedule needs this rank's model chunks (one per virtual stage)")
    schedule_vp = 1 + max((a.chunk for a in actions), default=0)
    if schedule_vp != len(chunks):
        raise ValueError(f"the schedule runs {schedule_vp} model chunk(s) per rank but "
                         f"{len(chunks)} were given; build it with vp = --virtual-pipeline-size = "
                         f"the number of chunks per rank")
    if any(a.microbatch >= num_microbatches for a in actions):
        raise ValueError(f"the schedule has more micro-batches than num_microbatches="
                         f"{num_microbatches}; build it with the same count")
    if clock is None:
        if ps.device.type != "cpu":
            raise ValueError(f"run_schedule on {ps.device.type} needs clock= (engine.device."
                             f"clock.DeviceClock): host stamps would time kernel launches, not kernels")
        clock = HostClock()
    if forward_only and any(a.kind in (B, W, RECV_B, SEND_B) for a in actions):
        raise ValueError("forward_only runs forwards and activation transfers only; build the "
                         "schedule with schedules.forward_only_schedule")
    split_w = has_weight_actions(actions)
    run = _RankRun(ps, chunks, forward_step, num_microbatches, tensor_shape, dtype, timeout_s,
                   clock, deallocate_outputs, waiter, placement, weight_grads, split_w,
                   scatter_gather, forward_only)
    ends = dict(batches(actions, ps.pp_rank, ps.pp_size, len(chunks), placement))
    i = 0
    while i < len(actions):
        a = actions[i]
        if a.is_comm:
            j = ends[i]   # one batch (actions.py ``batches``); the next compute step waits after
            # the last batch of the run: its receive may be in an earlier one (Exchange.wait_for)
            then = actions[j] if j < len(actions) and not actions[j].is_comm else None
            run.transfer(actions[i:j], then, i)
            i = j
            continue
        if a.kind == F:
            run.forward(a.microbatch, a.chunk)
        elif a.kind == B:
            run.backward(a.microbatch, a.chunk)
        elif a.kind == W:
            run.weight(a.microbatch, a.chunk)
        i += 1
    run.finish()
    leftover = len(run.inputs) + len(run.outputs) + len(run.grad_in) + len(run.grad_out)
    if leftover:
        raise RuntimeError(f"pipeline stage {ps.pp_rank}: {leftover} tensors left after the "
                           f"schedule (a forward without backward, an unsent output or gradient)")
    if weight_grads is not None and split_w and weight_grads.pending:
        raise RuntimeError(f"pipeline stage {ps.pp_rank}: weight gradients of "
                           f"{weight_grads.pending} never ran (a B without its W)")
    stacked = [run.losses[k] for k in sorted(run.losses)]
    losses = torch.stack(stacked) if stacked else None  # kept on the device: no sync here
    return PipelineResult(losses, run.peak, run.marks, clock.timebase(), ps.rank, run.spans)


def sum_embedding_grads(ps, params) -> None:
    """All-reduce the gradients of parameters tied between the first and last stage.

    With a tied word embedding the first stage (input embedding) and the last stage (output layer)
    each hold a copy; summing their gradients over ``ps.embedding_group`` keeps the copies equal
    after the optimizer step. A no-op with pp=1 and on middle stages. Both ends must pass the tied
    parameters in the same order; a missing gradient counts as zero.
    """
    if ps.pp_size == 1 or ps.embedding_group.size == 1:
        return
    params = list(params)
    if not params:
        return
    grads = []
    for p in params:
        if reduced_grad(p) is None:
            p.grad = torch.zeros_like(p)
        grads.append(reduced_grad(p))     # under ZeRO the shard: both stages hold the same range
    all_reduce_grads_([g for g in grads if g.numel()], ps.embedding_group)
