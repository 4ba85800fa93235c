"""Weights tied across processes: one parameter used by stages of several processes.

Found by identity in the whole model, before each process keeps only its
stages. Every process holding one keeps a copy, made equal at construction
(the first holder's values) and kept equal by summing each step's gradients
over the holders: a process group per set of holders, as Megatron's
embedding group, destroyed once the pipeline is closed.
"""

from __future__ import annotations

from itertools import accumulate, pairwise

import torch
import torch.distributed as dist
from torch import nn

from pipeline.runtime.layers import named_layers
from pipeline.step.gradients import GradientSums

__all__ = ["TiedWeights", "ties_across"]


class TiedWeights:
    """This process's tied parameters, by the processes holding them, with their groups."""

    def __init__(self, every: list[nn.Sequential], owner: list[int]) -> None:
        self.found = _tied_parameters(every, owner)
        self.groups: dict[tuple[int, ...], tuple[dist.ProcessGroup, list[nn.Parameter]]] = {}
        # This process's stages that hold tied weights: final only once summed.
        self.stages: set[int] = set()

    def resolve(
        self,
        partitions: list[nn.Sequential],
        local_stages: list[int],
        pipelines: list[list[int]],
        rank: int,
    ) -> None:
        """Collective over the job: the holders' groups, this process's parameters and stages."""
        for holders, subgroup in _tie_groups(pipelines, list(self.found), rank).items():
            params = []
            for occurrences in self.found[holders]:
                stage, name = next((s, n) for s, n in occurrences if s in local_stages)
                # By name in the partition: a split model's pieces hold their blocks
                # without registering them, so get_parameter cannot reach them.
                named = dict(partitions[stage].named_parameters(remove_duplicate=False))
                params.append(named[name])
            self.groups[holders] = (subgroup, params)
        self.stages = {
            s
            for s in local_stages
            for occurrences in self.found.values()
            for o in occurrences
            if any(stage == s for stage, _ in o)
        }

    def idle(self) -> bool:
        """Always, once the pipeline is closed: only its steps use these groups."""
        return True

    def take_groups(self) -> list[dist.ProcessGroup]:
        """The holders' groups, forgotten here: a closed pipeline sums no more gradients."""
        groups = [group for group, _ in self.groups.values()]
        self.groups = {}
        return groups

    def names(self) -> list[tuple[str, ...]]:
        """Every name of each tied parameter, in the whole model's order (every stage's)."""
        return [tuple(name for _, name in o) for found in self.found.values() for o in found]

    def synchronize(self) -> None:
        """Tied weights start equal: the first process holding them sends its values."""
        with torch.no_grad():
            for group, params in self.groups.values():
                for param in params:
                    dist.broadcast(param, group=group, group_src=0)

    def parameters(self) -> list[nn.Parameter]:
        """This process's tied parameters, in the same order in every process holding them."""
        return [param for _, tied in self.groups.values() for param in tied]

    def counted_elsewhere(self, rank: int) -> list[nn.Parameter]:
        """This process's tied parameters that a norm counts at their first holder, not here."""
        return [p for holders, (_, tied) in self.groups.items() if holders[0] != rank for p in tied]

    def training_states(self) -> list[int]:
        """Per tied parameter of the whole model: 0 not held here, 1 trained here, 2 frozen."""
        states = []
        for holders, found in self.found.items():
            held = self.groups.get(holders)
            if held is None:
                states += [0] * len(found)
            else:
                states += [1 if param.requires_grad else 2 for param in held[1]]
        return states

    def check_trained_alike(self, states: list[list[int]]) -> None:
        """Refuse a tied parameter that some holders freeze and others train.

        ``states``: every process's ``training_states()``, by rank. In the
        plain model it is one parameter, frozen in every use or in none.
        """
        for k, names in enumerate(self.names()):
            frozen = [rank for rank, row in enumerate(states) if row[k] == 2]
            trained = [rank for rank, row in enumerate(states) if row[k] == 1]
            if frozen and trained:
                raise ValueError(
                    f"the tied parameter {' = '.join(repr(n) for n in names)} is frozen "
                    f"(requires_grad=False) on rank(s) {frozen} but trained on {trained}; in the "
                    "plain model it is one parameter, frozen in every use or in none: set "
                    "requires_grad alike on every holder's copy (each of its names in "
                    "pipe.named_parameters(remove_duplicate=False))"
                )

    def sum_over_holders(self, sums: GradientSums) -> None:
        """Make each tied parameter's sum in ``sums`` the sum over the processes holding it.

        ``sums`` holds this step's gradients only (``.grad`` may hold earlier
        steps' too, from gradient accumulation or ``DataParallel.no_sync``,
        summed when they were made): only they are summed, then accumulated
        once, so that the parameter's hooks see the whole gradient.
        """
        for group, tied in self.groups.values():
            for param in tied:
                if not param.requires_grad:
                    continue  # frozen by every holder: the step's agreement checked
                grad = sums.take(param)
                total = grad if grad is not None else torch.zeros_like(param)
                dist.all_reduce(total, group=group)
                sums.add([param], [total])


def ties_across(module: nn.Sequential, balance: list[int], processes: int) -> bool:
    """Whether a parameter of ``module`` is used by stages of several of ``processes``
    (stage ``s`` in process ``s % processes``), before the pipe is built."""
    layers = list(named_layers(module).values())
    bounds = list(accumulate(balance, initial=0))
    owners: dict[int, set[int]] = {}
    for s, (a, b) in enumerate(pairwise(bounds)):
        for layer in layers[a:b]:
            for param in layer.parameters():
                owners.setdefault(id(param), set()).add(s % processes)
    return any(len(found) > 1 for found in owners.values())


def _tied_parameters(
    partitions: list[nn.Sequential], owner: list[int]
) -> dict[tuple[int, ...], list[list[tuple[int, str]]]]:
    """Parameters used by stages of different processes, by the processes holding them.

    Each parameter is listed as its (stage, name) occurrences, in registration
    order: the same in every process, which builds the whole module.
    """
    occurrences: dict[int, list[tuple[int, str]]] = {}
    for s, partition in enumerate(partitions):
        for name, param in partition.named_parameters(remove_duplicate=False):
            occurrences.setdefault(id(param), []).append((s, name))
    tied: dict[tuple[int, ...], list[list[tuple[int, str]]]] = {}
    for found in occurrences.values():
        holders = tuple(sorted({owner[s] for s, _ in found}))
        if len(holders) > 1:
            tied.setdefault(holders, []).append(found)
    return tied


def _tie_groups(
    pipelines: list[list[int]], ties: list[tuple[int, ...]], rank: int
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A process group per set of tied processes; those this process belongs to.

    ``new_subgroups_by_enumeration`` is collective over the whole job, so the
    groups of the other pipeline replicas are made too.
    """
    found: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for holders in ties:
        enumeration = [[ranks[h] for h in holders] for ranks in pipelines]
        subgroup, _ = dist.new_subgroups_by_enumeration(enumeration)
        if rank in holders:
            assert subgroup is not None, "every process is in one of the enumerated groups"
            found[holders] = subgroup
    return found
