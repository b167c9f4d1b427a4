"""Each view's batches epoch after epoch, from one data pipeline per view and round.

A data pipeline's first batch waits for Ray Data to plan and launch its readers and for the
first shard to be read; a pipeline per epoch paid that at every epoch boundary, on the CPUs the
training step needs. `EpochData` starts one pipeline per view for every epoch the round has left
(`pipeline.stages.train.data.round_batches`), so its readers run on into the next epoch while
this one trains, and hands out one epoch's batches at a time. The batches and their order are
those of a pipeline per epoch (a pure function of seed, view and epoch); an epoch cut short
(a rank without a batch ends it for all) leaves its remaining batches unread. A view that stops
(the warm-up's patience) has its pipeline closed, which ends its readers.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pipeline.stages.train.data import round_batches
from pipeline.stages.train.spec import TrainSpec, ViewSpec

__all__ = ["EpochData", "EpochStream"]


class EpochStream:
    """(epoch, batch) pairs, epochs ascending, handed out one epoch at a time."""

    def __init__(self, pairs: Iterator[tuple[int, dict[str, torch.Tensor]]]):
        self._pairs = pairs
        self._ahead: tuple[int, dict[str, torch.Tensor]] | None = None  # read, not handed out

    def epoch(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        """The batches of `epoch`; those of earlier epochs still unread are skipped."""
        while True:
            if self._ahead is None:
                self._ahead = next(self._pairs, None)
                if self._ahead is None:
                    return
            got, batch = self._ahead
            if got > epoch:
                return
            self._ahead = None
            if got == epoch:
                yield batch

    def close(self) -> None:
        """Stop the pipeline (Ray Data shuts its executor down when its iterator closes)."""
        close = getattr(self._pairs, "close", None)
        if close is not None:
            close()
        self._ahead = None


class EpochData:
    """The batches of each view and epoch on one rank, pixels normalised on `device`; `stop`
    ends a view's pipeline, `close` every one."""

    def __init__(self, spec: TrainSpec, rank: int, world: int, device: torch.device | None = None):
        self.spec, self.rank, self.world, self.device = spec, rank, world, device
        self._streams: dict[str, EpochStream] = {}

    def batches(self, views: list[ViewSpec], epoch: int) -> list[Iterator[dict[str, torch.Tensor]]]:
        """Per view, the epoch's batches; a view's pipeline starts at its first epoch asked."""
        out = []
        for view in views:
            if view.name not in self._streams:
                pairs = round_batches(self.spec, view, epoch, self.rank, self.world, self.device)
                self._streams[view.name] = EpochStream(pairs)
            out.append(self._streams[view.name].epoch(epoch))
        return out

    def stop(self, view: ViewSpec) -> None:
        stream = self._streams.pop(view.name, None)
        if stream is not None:
            stream.close()

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams = {}
