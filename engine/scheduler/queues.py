"""Waiting queues: first-come-first-served, or by priority (lower value first, then arrival)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from pagedserve.engine.config.engine import SchedulingPolicy
from pagedserve.engine.request.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        """Put a preempted request back in front: it keeps its place in line."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Heap ordered by (priority, arrival_time, insertion order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    prepend = add  # a preempted request's (priority, arrival) already puts it where it belongs

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def make_waiting_queue(policy: SchedulingPolicy) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy is SchedulingPolicy.PRIORITY else FCFSQueue()
