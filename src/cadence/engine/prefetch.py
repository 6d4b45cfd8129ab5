"""Input that overlaps compute: the next windows are prepared in a background thread while the current one runs.

Preparing a window (cutting the epoch's order into micro-batches, reading the examples, collating and padding them)
is host work that the accelerator would otherwise wait for at every step. :func:`prefetch` runs the window iterator
in a thread, ``depth`` windows ahead of the loop, and optionally copies each micro-batch to pinned (page-locked)
host memory there: on CUDA, a host-to-device copy is only asynchronous from pinned memory, so the engine's
``non_blocking`` copy of the next micro-batch is queued behind the current kernels instead of waiting for them. ::

    from cadence import Cut, Engine, epoch_windows, prefetch

    windows = epoch_windows(dataset, cut=Cut(micro_batch_size=8), grad_accum_steps=4, seed=0, epoch=0)
    with prefetch(windows, depth=2, pin_memory=torch.cuda.is_available()) as ahead:
        for window in ahead:
            engine.step(window)

Why the data order cannot change: the thread only pulls the iterator, one item after another, and hands the items
over in the order it pulled them; nothing is reordered, dropped or repeated. cadence's own window iterator
(``epoch_windows``) draws each epoch's order from a local ``torch.Generator`` seeded by (seed, epoch), never from
the global RNG, and collation draws no random numbers, so running it in another thread, earlier than the loop would
have, consumes nothing the loop (dropout, a user's sampling) draws from. An iterator that does use a shared RNG is
the caller's to keep out of a thread (``depth=0``).

Memory: at most ``depth`` items are prepared and not yet taken by the loop (the thread waits for room BEFORE it
prepares the next one), plus the one the loop holds.

The thread is stopped and joined when the prefetcher is closed: by ``close()``, by leaving its ``with`` block (an
exception or KeyboardInterrupt in the loop included), when it runs out, when the producer fails, and when it is
garbage collected. An exception raised by the iterator in the thread is raised again in the loop, at the position
it happened (the items before it are delivered first), with its original traceback.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

import torch

T = TypeVar("T")

THREAD_NAME = "cadence-prefetch"
"""The name of every prefetch thread (a test, or a user, can tell them apart from other threads by it)."""


def prefetch(items: Iterable[T], *, depth: int = 1, pin_memory: bool = False) -> Prefetcher[T]:
    """``items`` (windows, micro-batches, anything) prepared ``depth`` ahead in a background thread, in order.

    ``depth=0``: no thread, the iterator as it is (``pin_memory`` is then ignored: pinning in the loop's own thread
    would only add a copy before the transfer). ``pin_memory=True`` (CUDA only) copies every CPU tensor of each item
    (a Window's micro-batches, a mapping's values, tuple, list and dataclass fields) to pinned memory in the thread.
    Use it as an iterator and close it (or use it as a context manager); see the module docstring."""
    return Prefetcher(items, depth=depth, pin_memory=pin_memory)


class Prefetcher(Iterator[T]):
    """An iterator over ``items`` whose next ``depth`` items are prepared in a background thread (see
    :func:`prefetch`). Closing it stops and joins the thread; it is also a context manager that closes on exit."""

    def __init__(self, items: Iterable[T], *, depth: int = 1, pin_memory: bool = False) -> None:
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        if pin_memory and depth > 0 and not torch.cuda.is_available():
            raise ValueError("pin_memory needs CUDA: pinned host memory is what makes a copy to the GPU asynchronous")
        self.depth = depth
        self._source: Iterator[T] = iter(items)
        self._closed = False
        self._channel: _Channel | None = None
        self._thread: threading.Thread | None = None
        if depth == 0:
            return
        self._channel = _Channel(depth)
        # Pinning allocates through the current CUDA device's host allocator: the thread uses the loop's device
        # (a torchrun rank's), not device 0, which a new thread would otherwise start on.
        device = torch.cuda.current_device() if pin_memory else None
        # The thread gets the channel and the source, never this object: otherwise it would keep the prefetcher
        # alive, and garbage collection could never close it.
        self._thread = threading.Thread(
            target=_produce, args=(self._source, self._channel, pin_memory, device), name=THREAD_NAME, daemon=True
        )
        self._thread.start()

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._closed:
            raise StopIteration
        channel = self._channel
        if channel is None:
            return next(self._source)
        with channel.changed:
            while not channel.ready and not channel.finished:
                channel.changed.wait()
            if channel.ready:
                item = channel.ready.popleft()
                channel.changed.notify_all()  # room for the next one
                return item
            failure, channel.failure = channel.failure, None
        self.close()
        if failure is not None:
            # The producer's own exception: its traceback still holds the frames where it happened, below this one.
            raise failure
        raise StopIteration

    def close(self) -> None:
        """Stop the producer, drop what it prepared, close the source iterator and join the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        channel, thread = self._channel, self._thread
        if channel is None:
            _close_source(self._source)
            return
        with channel.changed:
            channel.stopped = True
            channel.ready.clear()  # the prepared windows' memory goes now, not when the thread is collected
            channel.changed.notify_all()
        # The thread finishes the item it is preparing (a Python thread cannot be interrupted), then exits; it closes
        # the source itself, since a generator cannot be closed while another thread runs it. Not while the
        # interpreter shuts down: daemon threads are frozen then, and a join would wait forever.
        if thread is None or thread.ident is None or thread is threading.current_thread() or sys.is_finalizing():
            return
        thread.join()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) is False:
            self.close()


class _Channel:
    """What the loop and the producer thread share, guarded by one condition variable."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.changed = threading.Condition()
        """Notified when an item is put or taken, the producer finishes, or the loop stops it."""
        self.ready: collections.deque[Any] = collections.deque()
        """Items prepared and not yet taken, oldest first (at most ``depth``)."""
        self.failure: BaseException | None = None
        """What the producer raised; delivered after the items it prepared before it."""
        self.finished = False
        """The producer has ended (ran out, failed or was stopped): nothing more will be put."""
        self.stopped = False
        """The loop closed the prefetcher: the producer stops at its next check."""


def _produce(source: Iterator[Any], channel: _Channel, pin_memory: bool, device: int | None) -> None:
    """The thread: pull ``source`` one item at a time while there is room, pin it when asked, hand it over."""
    try:
        if device is not None:
            torch.cuda.set_device(device)
        while True:
            with channel.changed:
                # Room first, then prepare: never more than ``depth`` items prepared ahead of the loop.
                while len(channel.ready) >= channel.depth and not channel.stopped:
                    channel.changed.wait()
                if channel.stopped:
                    return
            try:
                item = next(source)
            except StopIteration:
                return
            if pin_memory:
                item = pin_tensors(item)
            with channel.changed:
                if channel.stopped:
                    return
                channel.ready.append(item)
                channel.changed.notify_all()
    except BaseException as error:  # anything, so that the loop never waits for an item that will not come
        with channel.changed:
            channel.failure = error
    finally:
        try:
            _close_source(source)
        except BaseException as error:
            with channel.changed:
                channel.failure = channel.failure or error
        with channel.changed:
            channel.finished = True
            channel.changed.notify_all()


def _close_source(source: Iterator[Any]) -> None:
    """Close a generator source (its ``finally`` blocks run now, in order); other iterators have nothing to close."""
    close = getattr(source, "close", None)
    if callable(close):
        close()


def pin_tensors(item: T) -> T:
    """``item`` with every CPU tensor in it copied to pinned (page-locked) host memory: a tensor, a mapping's values,
    a tuple's or list's items, a dataclass's fields (a Window's micro-batches), recursively. Anything else, and a
    tensor already pinned or not on the CPU, is returned as it is. Needs CUDA."""
    if isinstance(item, torch.Tensor):
        pinned = item.pin_memory() if item.device.type == "cpu" and not item.is_pinned() else item
        return pinned  # type: ignore[return-value]  # a tensor for a tensor
    if isinstance(item, Mapping):
        pinned_items = {key: pin_tensors(value) for key, value in item.items()}
        return pinned_items  # type: ignore[return-value]  # a dict for any mapping (a batch is one)
    if isinstance(item, tuple) and hasattr(item, "_fields"):  # a NamedTuple
        return type(item)(*(pin_tensors(value) for value in item))
    if isinstance(item, (tuple, list)):
        return type(item)(pin_tensors(value) for value in item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        changes = {f.name: pin_tensors(getattr(item, f.name)) for f in dataclasses.fields(item) if f.init}
        return dataclasses.replace(item, **changes)
    return item
