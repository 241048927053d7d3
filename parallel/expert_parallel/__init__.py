"""Expert parallelism: the process groups of the expert grid (``groups``), the routing metadata on
the device (``permute``: counting assignments per expert, the permutation by expert and its
inverse, the row offsets of the grouped GEMMs, the weighted combine), the token exchange of
mixture-of-experts layers (``dispatch``: the all-to-all with per-expert split sizes and its
inverse; ``allgather``: every rank gathers the EP group's tokens and routing, keeps its experts'
assignments, and reduce-scatters the weighted outputs back; one autograd.Function per pattern)
and the one host read a layer makes under EP (``host_read``: a pinned, non-blocking copy on a side
stream, waited for at the latest point).

The rank arithmetic itself is pure and lives in parallel/grid/expert_groups.py; the model side
(router, experts, the MoE layer) in models/moe/.
"""
from parallel.expert_parallel.allgather import allgather_combine, allgather_dispatch
from parallel.expert_parallel.dispatch import alltoall_combine, alltoall_dispatch, alltoall_plan
from parallel.expert_parallel.groups import init_expert_groups
from parallel.expert_parallel.host_read import HostReader
from parallel.expert_parallel.permute import (Permutation, count_per_expert, permute_padded,
                                              permute_tokens, unpermute_tokens)

__all__ = ["HostReader", "Permutation", "allgather_combine", "allgather_dispatch",
           "alltoall_combine", "alltoall_dispatch", "alltoall_plan", "count_per_expert",
           "init_expert_groups", "permute_padded", "permute_tokens", "unpermute_tokens"]
