"""Replica checksums: silent data corruption that makes data-parallel replicas drift apart.

After an optimizer step every data-parallel replica of a parameter (each DDP rank; the ranks along
HSDP's replicate dimension, which hold the same shard) holds bitwise the same tensor: they started
equal, received the same reduced gradient and ran the same optimizer arithmetic. A flipped bit in
one device's weight, gradient or optimizer moment breaks that, and nothing else notices: the loss
of the other replicas looks fine, and a checkpoint stores one replica's copy.

Every ``guard.replica_every`` steps (and at each checkpoint step, so a checkpoint is checked when
written) each rank computes an exact checksum of its local copy of every parameter and optimizer
state tensor: the tensor's bytes viewed as integers (int32 for fp32, int16 for bf16) and summed in
int64. Integer addition is exact and order-free, so equal tensors give equal sums on any device, and
a single flipped bit changes the sum by ``±2**k``. (A permutation of elements would not change it:
corruption flips bits, it does not move values.) One all-reduce of a ``(world, tensors)`` int64 table
gives every rank every checksum. Within each group of replicas the majority value (with >= 3
replicas) is the healthy one and the ranks that disagree are named; with 2 replicas both are.

On a mismatch an event (kind ``replica_mismatch``) names the ranks, the tensors, the check that saw
it first and the last check that found the replicas equal; ``guard.replica_action`` then reports,
stops with an error, or rolls back (verdict ROLLBACK at the next step) to the newest checkpoint at or
before that last clean check, which every replica reloads.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from densetrain.config.recovery import GuardConfig
from densetrain.errors import TrainError
from densetrain.parallel import DistInfo, Layout
from densetrain.train.watchers import Verdict, Watcher

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Exact checksum of ``t``'s local data (a DTensor's shard): its bytes viewed as integers of the
    element width (int32 for 8-byte elements) summed in int64; a 0-d int64 tensor on ``t``'s device."""
    local = t.to_local() if hasattr(t, "to_local") else t
    flat = local.detach().contiguous().view(-1)
    return flat.view(_INT_VIEW[flat.element_size()]).sum(dtype=torch.int64)


def replica_groups(layout: Layout) -> list[list[int]]:
    """The groups of global ranks that hold identical parameter tensors: ranks that differ only in their
    ``dp_replicate`` coordinate, when that dimension replicates (DDP: every rank; HSDP: the 2-D mesh's
    replicate dim). ``[]`` when nothing is replicated (one process, FSDP alone, FSDP over the replicate
    dim with tensor parallel)."""
    pp = getattr(layout, "pp", 1)
    # Under pipeline parallelism data-parallel ranks always use FSDP2: over dp_replicate alone it shards.
    replicated = layout.dp_replicate > 1 and (layout.dp_shard > 1 or (layout.tp == 1 and pp == 1))
    if not replicated:
        return []
    inner = layout.dp_shard * layout.cp * layout.tp  # mesh row-major, pp then dp_replicate outermost (parallel/mesh.py)
    stage = layout.world // pp
    return [[s * stage + k + r * inner for r in range(layout.dp_replicate)] for s in range(pp) for k in range(inner)]


def odd_ranks(group: list[int], values: list[int]) -> tuple[list[int], bool]:
    """The ranks of ``group`` whose checksum (``values``, same order) differs from the majority, and
    whether there was a strict majority; without one (2 replicas, a tie) every rank is named."""
    value, count = Counter(values).most_common(1)[0]
    if count * 2 > len(values):
        return [r for r, v in zip(group, values) if v != value], True
    return list(group), False


class ReplicaCheck(Watcher):
    """Compare replica checksums every ``guard.replica_every`` steps (module docstring)."""

    name = "replicas"

    def __init__(self, cfg: GuardConfig, info: DistInfo):
        self.every, self.action, self.max_rollbacks = cfg.replica_every, cfg.replica_action, cfg.max_rollbacks
        self.rank, self.world = info.rank, info.world_size
        self.groups = replica_groups(info.layout)
        self.clean = 0  # update count (metrics step) of the last check that found every replica equal
        self.seen: set[str] = set()  # tensors already reported as differing (reported once)
        self.rollback_to: int | None = None  # set on a mismatch with action 'rollback'
        self.rollbacks = 0

    def _tensors(self, run) -> tuple[list[str], list[torch.Tensor]]:
        names, tensors = [], []
        for n, p in run.model.named_parameters():
            names.append(n)
            tensors.append(p)
            for k, v in sorted(run.optimizer.state.get(p, {}).items()):
                if torch.is_tensor(v):
                    names.append(f"{n}:{k}")
                    tensors.append(v)
        return names, tensors

    def judge(self, run, result) -> Verdict:
        if self.rollback_to is None:
            return Verdict.APPLY
        result.rollback_before = self.rollback_to
        return Verdict.ROLLBACK

    def after_step(self, run, result, verdict: Verdict) -> None:
        if verdict == Verdict.ROLLBACK:  # every replica reloaded the checkpoint: equal again
            self.rollback_to, self.seen, self.clean = None, set(), min(self.clean, run.state.step)
            return
        step = run.state.step
        if step % self.every and not run.checkpointer.due(step):
            return
        names, tensors = self._tensors(run)
        # Pipeline stages hold different tensors (and counts): the table is as wide as the most any rank holds,
        # shorter rows padded with zeros (a replica group lies within one stage, so its rows align).
        width = torch.tensor([len(tensors)], dtype=torch.int64, device=run.info.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        table = torch.zeros(self.world, int(width), dtype=torch.int64, device=run.info.device)
        table[self.rank, :len(tensors)] = torch.stack([checksum(t) for t in tensors])
        dist.all_reduce(table)  # every rank's row on every rank (the others add zeros: exact in int64)
        rows = table.cpu().tolist()
        odd: dict[int, dict[int, list[int]]] = {}  # group index -> column -> ranks; judged alike on every rank
        majority = True
        for g, group in enumerate(self.groups):
            for j in range(int(width)):
                ranks, ok = odd_ranks(group, [rows[r][j] for r in group])
                if ranks:
                    odd.setdefault(g, {})[j] = ranks
                    majority &= ok
        if not odd:
            self.clean = step
            return
        differ = self._named(names, odd)
        new = sorted(set(differ) - self.seen)
        if new:
            self._report(run, result, differ, new, majority)

    def _named(self, names: list[str], odd: dict[int, dict[int, list[int]]]) -> dict[str, list[int]]:
        """``{tensor name: odd ranks}`` of a mismatch: the names are those of the group's own ranks (under pipeline
        parallelism another stage's), gathered from every rank (a collective every rank runs: each judged the
        same table alike)."""
        everyone: list[list[str] | None] = [None] * self.world
        dist.all_gather_object(everyone, names)  # the ranks' own processes, not a file: nothing untrusted
        differ: dict[str, list[int]] = {}
        for g, columns in odd.items():
            group_names = everyone[self.groups[g][0]]
            for j, ranks in columns.items():
                differ.setdefault(group_names[j], []).extend(ranks)
        return differ

    def _report(self, run, result, differ: dict[str, list[int]], new: list[str], majority: bool) -> None:
        self.seen |= set(differ)
        ranks = sorted({r for rs in differ.values() for r in rs})
        action = self.action
        if action == "rollback" and self.rollbacks >= self.max_rollbacks:
            action = "stop"
        who = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if majority else
               f"ranks {', '.join(map(str, ranks))} (no majority among the replicas: any of them)")
        text = (f"replicas differ after step {run.state.step} (equal at step {self.clean}): {who} hold"
                f"{'s' if majority and len(ranks) == 1 else ''} another copy of {new[0]}"
                + (f" and {len(differ) - 1} more tensors" if len(differ) > 1 else "")
                + {"report": "", "rollback": "; rolling back", "stop": "; stopping"}[action])
        run.log.event(result.index, text, kind="replica_mismatch", action=action,
                      values={"ranks": ranks, "majority": majority, "since_step": run.state.step,
                              "clean_step": self.clean, "tensors": {n: differ[n] for n in sorted(differ)[:50]},
                              "n_tensors": len(differ)})
        if action == "stop":
            raise TrainError(text + ": the device of " + who + " is suspect; exclude that node and resume from a "
                             f"checkpoint at or before step {self.clean}")
        if action == "rollback":
            self.rollback_to = self.clean
            self.rollbacks += 1

    def state_dict(self) -> dict:
        return {"clean": self.clean}

    def load_state_dict(self, d: dict) -> None:
        self.clean = d.get("clean", self.clean)
