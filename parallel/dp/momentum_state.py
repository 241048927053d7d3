"""The momentum a compressor keeps between exchanges, for the compressors that exchange Adam's
first moment instead of the gradient: 1-bit Adam's synchronized momentum M (onebit.py) and Deep
Gradient Compression's local velocity u_r (dgc.py).

The state is unscaled (in the optimizer's units, whatever the loss scale), one (n,) tensor laid out
like the bucket. It is seeded from the optimizer's exp_avg when compression starts and after a
checkpoint is loaded onto another layout (``set_momentum``; under ZeRO each rank holds only its
shard of exp_avg, ``set_momentum_shard``, and the first exchange all-gathers the shards on the
exchange's communicator); on the same layout the saved tensor is restored exactly. A skipped step
(overflow) puts back the momentum of the step before (``reset``), as the base class puts back the
residuals; a step run again from its start (``--rerun-on-anomaly``) gets the momentum and the seed
shard it started from (``rerun_state``).
"""
from __future__ import annotations

import torch

from parallel.runtime import streams


class MomentumState:
    """Mixin for a ``Compressor`` subclass: the momentum, its seeding, checkpointing and undo."""
    exchanges_momentum = True      # the exchanged buffer is the optimizer's new first moment

    def _init_momentum(self, beta1: float) -> None:
        if not 0.0 <= beta1 < 1.0:
            raise ValueError(f"{type(self).__name__}: beta1 must be in [0, 1), got {beta1}")
        self.beta1 = beta1
        self.loss_scale = lambda: 1.0                 # the trainer's scale, set by bind_momentum
        self.momentum: torch.Tensor | None = None     # (n,) unscaled
        self._previous: torch.Tensor | None = None    # the momentum before the latest exchange
        self._can_undo = False
        self._seed_shard: torch.Tensor | None = None  # ZeRO: this rank's shard to gather

    # ---- state ---------------------------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """Everything held between steps (memory accounting), the seed shard waiting for its
        gather included."""
        held = (self.momentum, self._previous, self._seed_shard)
        return super().state_tensors() + [t for t in held if t is not None]

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = super().state_dict()
        if self.momentum is not None:
            out["momentum"] = self.momentum
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        state = dict(state)
        momentum = state.pop("momentum", None)
        super().load_state_dict(state)
        if momentum is not None:
            self.momentum, self._seed_shard = momentum.clone().float(), None
            self._previous, self._can_undo = None, False

    def rerun_state(self) -> tuple:
        """Copies of what an exchange changes besides the residuals: the momentum (None before
        the first exchange) and, under ZeRO, the seed shard still to gather. A step run again from
        its start (engine/observe/anomaly.py ``StepInputs``) needs both: the checkpoint's view
        (``state_dict``) has no key for a momentum not made yet (loading it keeps the advanced
        one) and never holds the seed."""
        return tuple(None if t is None else t.clone() for t in (self.momentum, self._seed_shard))

    def load_rerun_state(self, state: tuple) -> None:
        """Back to what ``rerun_state`` copied (copied again: the caller's copies stay intact)."""
        self.momentum, self._seed_shard = (None if t is None else t.clone() for t in state)
        self._previous, self._can_undo = None, False

    def reset(self) -> None:
        """After a skipped step: the residuals and the momentum of the step before come back."""
        super().reset()
        if self._can_undo:
            self.momentum, self._previous = self._previous, self.momentum
            self._can_undo = False

    def set_momentum(self, full: torch.Tensor) -> None:
        """The momentum from the optimizer's exp_avg laid out like the bucket (unscaled)."""
        self.momentum = full.detach().float().clone()
        self._seed_shard, self._previous, self._can_undo = None, None, False

    def set_momentum_shard(self, shard: torch.Tensor) -> None:
        """ZeRO: this rank's shard of the momentum; the next exchange all-gathers the shards."""
        self._seed_shard = shard.detach().float().clone()
        self.momentum, self._previous, self._can_undo = None, None, False

    # ---- during an exchange --------------------------------------------------------------------
    def _momentum_now(self, n: int, group) -> torch.Tensor:
        """The momentum before this exchange (gathering a seeded ZeRO shard first)."""
        seed = self._seed_shard
        if seed is not None:
            gathered = torch.empty(group.size, seed.numel(), dtype=torch.float32,
                                   device=seed.device)
            group.all_gather_into(gathered, seed.unsqueeze(0))
            # the seed was made on the compute stream, the gather may run on the exchange's: its
            # block goes back to compute's pool only after this stream's gather (NCCL keeps no
            # tensor of a synchronous collective alive)
            streams.record_stream(seed, streams.current_stream(seed.device))
            streams.released(seed)
            self.momentum, self._seed_shard = gathered.view(-1)[:n].clone(), None
        if self.momentum is None or self.momentum.numel() != n:
            self.momentum = torch.zeros(n, dtype=torch.float32, device=self.residual.device)
        return self.momentum

    def _spare(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor for the new momentum: the one from two exchanges ago when it fits."""
        prev = self._previous
        return prev if prev is not None and prev.shape == like.shape else torch.empty_like(like)

    def _advance(self, old: torch.Tensor, new: torch.Tensor) -> None:
        self._previous, self.momentum, self._can_undo = old, new, True
