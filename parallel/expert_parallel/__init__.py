"""Expert parallelism: the process groups of the expert grid (``groups``) and the token
exchange of mixture-of-experts layers (``dispatch``: permutation by expert, the all-to-all with
per-expert split sizes, and their inverses; ``allgather``: every rank gathers the EP group's tokens
and routing, keeps its experts' assignments, and reduce-scatters the weighted outputs back; one
autograd.Function per pattern).

The rank arithmetic itself is pure and lives in parallel/expert_groups.py; the model side (router,
experts, the MoE layer) in models/moe/.
"""
from parallel.expert_parallel.allgather import allgather_combine, allgather_dispatch
from parallel.expert_parallel.dispatch import (alltoall_combine, alltoall_dispatch, permute_padded,
                                               permute_tokens, unpermute_tokens)
from parallel.expert_parallel.groups import init_expert_groups

__all__ = ["allgather_combine", "allgather_dispatch", "alltoall_combine", "alltoall_dispatch",
           "permute_padded", "permute_tokens", "unpermute_tokens", "init_expert_groups"]
