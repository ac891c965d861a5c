"""The noise's standard normals drawn ahead, off the critical path of a step.

The Gaussian noise of a release does not depend on the data: its normals are ``draws.normals(key, NOISE,
draw, 0, d)``, a pure function of the key and the noise stage's draw counter (``step.GaussianNoise``).
So the engine starts drawing them when a step begins (``start``), in a background thread, and the noise
stage takes them when the step's sums are ready (``take``): the draw runs while the forward and backward
run. The thread's heavy work releases the GIL (OpenSSL's ChaCha20, numpy's and torch's vector operations);
on a CUDA device it queues its kernels on a side stream, and the stream that takes the normals waits for it.

Exactly the same bits: ``take`` hands the draw over only when its address (key, purpose, draw, count,
device) is the one asked for, else returns None and the caller draws on the spot; the values are those of
``draws.normals``, which are those ``snapped_gaussian`` draws piece by piece. Nothing here is state of the
run: the draw counter moves only when the noise stage commits, so a checkpoint, a resume or a failed step
neither consumes nor skips a draw (a resumed run asks for the draw at its own counter; a step that failed
before its release keeps its draw for the retry, one that failed after it draws again: the same values).

Memory: one float64 vector of the update's size (8 bytes a coordinate), reused from draw to draw (a fresh
vector of hundreds of MB would fault in all its pages at every step) while the stage draws ahead.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from .draws import normals
from .key import SecretKey


DEFAULT = False
"""What ``prefetch=None`` (``DPEngine``'s default) does: off, since drawing ahead was no win where measured: 2 AMD
EPYC cores (KVM), two engines alternating in one process, parameters bit-identical after every round
(``benchmarks/noise_prefetch.py``; ``benchmarks/results/speed/noise_prefetch.json``), ratio of median step times
drawing ahead / not, dpsgd on the fast path, B = 16, two runs each with the machine otherwise idle: an MLP of 20.0M
parameters 1.27x and 1.20x (with one torch thread 1.15x and 0.92x), of 1.9M 1.18x and 1.13x, of 0.27M 1.83x and
1.30x; the 26k-parameter cnn at B = 256 1.04x and 1.10x (``benchmarks/speed.py``). BERT-base and GPT-2 small at
B = 8, T = 128 0.98x and 1.01x (load 2-3): their steps keep both cores busy (CPU time twice the wall time), so the
thread has no idle core to fill, and on the MLPs it adds CPU time (memory traffic of two threads at once, four
OpenMP threads on two cores). With other processes loading the cores (load 2.5-3) the MLPs' ratio was 0.52-0.68x,
a scheduling effect, not a setting to default to. Not measured on a GPU (where the draw runs on a side stream)."""


def wanted(setting: bool | None) -> bool:
    """Whether a noise stage with ``prefetch=setting`` draws its normals ahead: True or False as set, None:
    ``DEFAULT``."""
    return DEFAULT if setting is None else bool(setting)


class NormalsPrefetch:
    """At most one draw of normals made ahead (``start``), handed over by the address it was started for
    (``take``), into one buffer reused from draw to draw."""

    def __init__(self) -> None:
        self._job: _Job | None = None
        self._buffer: Tensor | None = None  # the vector the draws are written into (one, whatever the steps)

    def start(self, key: SecretKey, purpose: int, step: int, count: int, device: torch.device | str) -> None:
        """Draw ``normals(key, purpose, step, 0, count, device)`` in the background, unless that draw is
        already made or under way (a step retried after a failure in its sums reuses it); any other draw
        is dropped."""
        address = _address(purpose, step, count, device)
        if self._job is not None and self._job.matches(key, address):
            return
        self.clear()
        buffer = self._buffer
        if buffer is None or buffer.shape != (count,) or buffer.device != address[3]:
            buffer = self._buffer = None  # (freed before the new one is made)
        self._job = _Job(key, address, buffer)

    def take(self, key: SecretKey, purpose: int, step: int, count: int, device: torch.device | str) -> Tensor | None:
        """The normals of that address, drawn ahead, handed over (the caller may scale them in place; asked
        again, the draw is made on the spot), or None where no draw of that address was started or it
        failed (the caller draws them)."""
        job = self._job
        if job is None or not job.matches(key, _address(purpose, step, count, device)):
            return None
        self._job = None
        z = job.result()
        self._buffer = z  # written again by the next draw, once the caller is done with it (the next step)
        return z

    def clear(self) -> None:
        """Drop the draw (after waiting for a thread still making it: none outlives the step)."""
        job, self._job = self._job, None
        if job is not None:
            job.thread.join()
            if job.value is not None:
                self._buffer = job.value

    def wait(self) -> None:
        """Wait for a draw under way, keeping it."""
        if self._job is not None:
            self._job.thread.join()

    def release(self) -> None:
        """Drop the draw and the buffer (a stage that no longer draws ahead holds no memory for it)."""
        self.clear()
        self._buffer = None

    @property
    def pending(self) -> bool:
        """Whether a draw is held or under way."""
        return self._job is not None

    def __reduce__(self):  # a copy or a pickle of a stage holds no draw (and no thread)
        return (type(self), ())


def _address(purpose: int, step: int, count: int, device: torch.device | str) -> tuple:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return int(purpose), int(step), int(count), device


class _Job:
    """One draw in a thread, into ``buffer`` when given: on a CUDA device under a side stream that first
    waits for the work queued so far on the caller's stream (the previous release read the buffer there),
    with an event that marks the draw's end."""

    _streams: dict = {}  # one side stream per CUDA device, shared by the jobs on it

    def __init__(self, key: SecretKey, address: tuple, buffer: Tensor | None) -> None:
        self.key, self.address, self.buffer = key, address, buffer
        self.value: Tensor | None = None
        self.stream = self.event = None
        device = address[3]
        if device.type == "cuda":
            self.stream = _Job._streams.get(device)
            if self.stream is None:
                self.stream = _Job._streams.setdefault(device, torch.cuda.Stream(device))
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.thread = threading.Thread(target=self._run, name="clipbias-noise-prefetch", daemon=False)
        self.thread.start()

    def matches(self, key: SecretKey, address: tuple) -> bool:
        return self.address == address and self.key == key

    def _run(self) -> None:
        purpose, step, count, device = self.address
        try:
            if self.stream is not None:
                with torch.cuda.device(device), torch.cuda.stream(self.stream):
                    z = normals(self.key, purpose, step, 0, count, device, out=self.buffer)
                    self.event = torch.cuda.Event()
                    self.event.record(self.stream)
            else:
                z = normals(self.key, purpose, step, 0, count, device, out=self.buffer)
            self.value = z
        except BaseException:  # out of memory, ...: the caller draws on the spot (the same values, or the error)
            self.value = None

    def result(self) -> Tensor | None:
        self.thread.join()
        z = self.value
        if z is not None and self.event is not None:  # the taking stream waits for the side stream's kernels
            current = torch.cuda.current_stream(z.device)
            current.wait_event(self.event)
            z.record_stream(current)  # the caching allocator keeps the memory until that stream is done with it
        return z
