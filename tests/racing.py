"""Exactly once, as the tests check it: deadlines race transfers, then every
key is asked again.

A consumer asks for each of ``n`` tensors with a short deadline (2-20 ms by
default) and, each time it passes, asks again with a deadline half as long
again, until the tensor arrives; meanwhile the producer is producing them.
Once every tensor has arrived (each checked against its own value), every
key is asked once more with a short deadline: any answer is the same tensor
delivered a second time. The callers then check that nothing is pending
anywhere (tables, kept tensors, streams).

Used in-process by ``test_no_loss.py`` (rank servers, one and two daemons,
both local clients) and under ``mpiexec`` by ``mpi_scenarios.exactly_once``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rendezvous.errors import DeadlineExceeded

#: the two sizes every race mixes: inside a frame, and above every threshold
#: of the fast paths (MPI's, the daemon's shared memory)
SIZES = (16, 256 << 10)

#: recv(index, timeout) -> the array; raises DeadlineExceeded when the deadline passes
Recv = Callable[[int, float], Awaitable[Any]]


def value(i: int, sizes: tuple[int, ...] = SIZES) -> np.ndarray:
    """Tensor ``i``: its size from ``sizes`` in turn, every element ``i``."""
    return np.full(sizes[i % len(sizes)] // 4, i, np.int32)


def matches(got: Any, i: int, sizes: tuple[int, ...] = SIZES) -> bool:
    want = value(i, sizes)
    return isinstance(got, np.ndarray) and got.shape == want.shape and bool((got == i).all())


@dataclass
class Tally:
    """What a race saw."""

    n: int
    timed_out: int = 0
    wrong: list[int] = field(default_factory=list)  # arrived with another tensor's contents
    twice: list[int] = field(default_factory=list)  # answered again after the race: delivered twice

    def check(self) -> None:
        assert not self.wrong, f"tensors that arrived with the wrong contents: {self.wrong[:20]}"
        assert not self.twice, (f"{len(self.twice)} of {self.n} tensors were delivered twice "
                                f"(asked again after the race, they answered): {self.twice[:20]}")
        assert self.timed_out > 0, "no deadline passed: the race was not exercised"


async def race(recv: Recv, n: int, *, seed: int = 0, shortest: float = 0.002, longest: float = 0.02,
               in_flight: int = 1 << 30, sizes: tuple[int, ...] = SIZES) -> Tally:
    """Receive tensors ``0..n-1`` through ``recv`` with racing deadlines (see the
    module's notes); each must arrive once with its own contents."""
    rng = random.Random(seed)
    tally = Tally(n)
    window = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with window:
            deadline = rng.uniform(shortest, longest)
            while True:
                try:
                    got = await recv(i, deadline)
                    break
                except DeadlineExceeded:
                    tally.timed_out += 1
                    deadline *= 1.5
            if not matches(got, i, sizes):
                tally.wrong.append(i)

    await asyncio.gather(*(one(i) for i in range(n)))
    return tally


async def race_batches(recv_many: Callable[[list[int], float], Awaitable[list[Any]]], n: int, *, size: int = 10,
                       seed: int = 0, shortest: float = 0.002, longest: float = 0.02,
                       sizes: tuple[int, ...] = SIZES) -> Tally:
    """:func:`race` with ``recv_many``: tensors ``0..n-1`` in batches of ``size``,
    every batch asked with a racing deadline until it arrives whole (a batch
    that fails consumes nothing)."""
    rng = random.Random(seed)
    tally = Tally(n)

    async def one(start: int) -> None:
        ids = list(range(start, min(n, start + size)))
        deadline = rng.uniform(shortest, longest)
        while True:
            try:
                got = await recv_many(ids, deadline)
                break
            except DeadlineExceeded:
                tally.timed_out += 1
                deadline *= 1.5
        tally.wrong.extend(i for i, g in zip(ids, got) if not matches(g, i, sizes))

    await asyncio.gather(*(one(s) for s in range(0, n, size)))
    return tally


async def ask_again(recv: Recv, tally: Tally, timeout: float = 0.3) -> Tally:
    """Ask every key once more, all at once: each that answers was delivered twice."""
    async def one(i: int) -> None:
        try:
            await recv(i, timeout)
        except DeadlineExceeded:
            return
        tally.twice.append(i)

    await asyncio.gather(*(one(i) for i in range(tally.n)))
    tally.twice.sort()
    return tally


async def paced(produce: Callable[[int], Awaitable[None] | None], n: int, every: int = 10) -> None:
    """Produce tensors ``0..n-1`` while the consumer asks, yielding to the loop
    every ``every`` of them (so recvs wait, time out and race the replies)."""
    for i in range(n):
        done = produce(i)
        if done is not None:
            await done
        if i % every == every - 1:
            await asyncio.sleep(0)
