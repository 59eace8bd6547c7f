"""Sampled tokens from the last stage straight to the first, for steps planned ahead (``Step.send_back`` /
``take_back``); split from :mod:`energon_infer.worker.workers`, whose loop uses it."""

from __future__ import annotations

from typing import Any

import torch

from energon_infer.protocol import Step

__all__ = ["TokenFeedback"]


class TokenFeedback:
    """Sampled tokens from the last stage straight to the first (steps planned ahead, ``Step.send_back``).

    The result rank sends each ``send_back`` step's tokens to every first-stage rank (point to point,
    tag ``100 + group``; kept in memory where it is a first-stage rank itself); the first stage keeps
    that step's sequence ids, and at the group's next step (``take_back``) puts each sequence's token
    in place of its placeholder. Ranks of other stages only need the token count: they feed zeros.
    """

    def __init__(self, grid: Any, device: torch.device):
        self.grid, self.device = grid, device
        self.ids: dict[int, list[int]] = {}
        self.local: dict[int, list[int]] = {}
        self.sends: dict[int, list[Any]] = {}
        self.keep: dict[int, torch.Tensor] = {}

    def give(self, cmd: Step, tokens: list[int]) -> None:
        grid = self.grid
        if grid.first:  # a late step run alone adds to the tokens of the step before it (one rank: no sends)
            ids = [s for s, _ in cmd.items]
            self.ids[cmd.group] = self.ids.get(cmd.group, []) + ids if cmd.late else ids
        if grid.rank != grid.result_rank:
            return
        # The group's previous send was received when its next step (this one) started on the first stage.
        for work in self.sends.pop(cmd.group, []):
            work.wait()
        out = torch.tensor(tokens, dtype=torch.long, device=self.device)
        works = []
        for dst in range(grid.tp):  # the first stage's ranks
            if dst == grid.rank:
                self.local[cmd.group] = self.local.get(cmd.group, []) + list(tokens) if cmd.late else list(tokens)
            else:
                works.append(torch.distributed.isend(out, dst=dst, tag=100 + cmd.group))
        self.sends[cmd.group] = works
        self.keep[cmd.group] = out  # alive until its sends complete

    def take(self, cmd: Step) -> list[tuple[int, list[int]]]:
        grid = self.grid
        if not grid.first:
            return [(s, [0] if t == [-1] else t) for s, t in cmd.items]
        ids = self.ids.pop(cmd.group)
        if grid.rank == grid.result_rank:
            got = self.local.pop(cmd.group)
        else:
            buf = torch.empty(len(ids), dtype=torch.long, device=self.device)
            torch.distributed.recv(buf, src=grid.result_rank, tag=100 + cmd.group)
            got = buf.tolist()
        prev = dict(zip(ids, got))
        return [(s, [prev[s]] if t == [-1] else t) for s, t in cmd.items]
