"""Batches of a :class:`~dlrmctl.data.loader.BatchLoader` assembled in worker processes.

A step whose host side holds the GIL (a GPU step's Python kernel launches) leaves a loader
thread of the same process almost no time to gather rows; a process has its own interpreter.
With ``workers = N > 0`` each ``iter()`` forks ``N`` workers (what ``torch.utils.data``
DataLoader workers do; the loader's mapped shards, windows and settings are inherited, nothing
is re-opened; the rank's pages are shared copy-on-write, so a page the rank writes during the
epoch is copied once: small on CUDA, up to the tables' size on a CPU run, where ``auto`` gives
no workers).  Worker ``k`` makes the global batches ``i`` with ``i % N == k``, in order, with
the loader's own code (:meth:`BatchLoader._part`): the same rows, multi-hot draws and id checks
as one thread would, so batches are bit-identical and come in the same order whatever ``N``.
In a shuffled epoch a worker reads, of each shuffle window, only the blocks' rows of its own
batches' positions (the row range of a block it needs: close to the whole window, so reads
grow with ``N`` while the gathers are divided by it).

Transport: each worker writes a finished batch into a free slot of a shared anonymous mapping
(``MAP_SHARED | MAP_NORESERVE``: pages are committed when written, nothing stays in
``/dev/shm``, nothing outlives the processes) and sends its layout (a few numbers) over a socket
pair.  The consumer's tensors view the slot (no copy), which goes back to the worker once they
are all gone (a finalizer); on CUDA they are copied into pinned memory and the slot goes back at
once.  A worker runs at most ``depth`` batches ahead: it takes a credit of its counting semaphore
for each batch it sends, and blocks on it (no polling) while it has none; the consumer gives one
back for each batch it receives.  Each slot has a binary semaphore, posted when the slot is free
again and taken (without waiting) by its worker to write into it.  POSIX semaphores synchronise
memory (``sem_post`` / ``sem_wait``, IEEE Std 1003.1 XBD 4.12), so what the consumer read from a
slot precedes the worker's next writes on any processor, not only x86's ordered stores; neither
side makes a system call for them unless the worker waits.  A batch larger than a slot, or made
while the consumer still holds every slot of its worker, travels pickled over the socket instead.

Failures: an exception in a worker reaches the consumer as that exception (its traceback noted),
naming the worker; a worker that dies (killed, out of memory) is an error naming the worker, its
pid and its signal or exit code within a fraction of a second (one that makes no batch in
:data:`WORKER_STALL_S` is killed and named the same way; one that is stopped, SIGSTOP or a debugger,
or blocked in uninterruptible I/O for ``$DLRMCTL_STALL_TIMEOUT_S``, the limit of the stalled-rank
watchdog of :mod:`dlrmctl.stall_watch`, is named so while the consumer waits); ``close`` (the end of the epoch,
an exception or ``KeyboardInterrupt`` in the step, the iterator dropped) kills and reaps every
worker.  Workers ignore SIGINT (Ctrl-C reaches the whole process group; the consumer decides)
and exit by themselves when their parent is gone.
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import multiprocessing
import os
import pickle
import signal
import time
import traceback
import warnings
import weakref
from multiprocessing import connection
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from dlrmctl.data.batch import Batch
from dlrmctl.errors import CommandError, ProcessFailure, UserError
from dlrmctl.procs import proc_stat
from dlrmctl.stall_watch import ENV_LIMIT, POLL_S as _STATE_POLL_S, STALLED_STATES, stall_limit_s
from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor

if TYPE_CHECKING:
    from dlrmctl.data.loader import BatchLoader

__all__ = ["WorkerError", "auto_workers", "worker_batches", "MAX_AUTO_WORKERS", "WORKER_STALL_S"]

#: most workers ``workers: auto`` gives one rank
MAX_AUTO_WORKERS = 4
#: seconds a live worker may take over its next batch before the consumer gives up on it (far
#: above a shuffle window's read: a worker stuck for good, not a slow one)
WORKER_STALL_S = 600.0
#: seconds between the checks of a waiting side on the other one (alive? parent gone?)
_POLL_S = 0.1
_ALIGN = 64
#: slots per worker beyond its batches ahead: batches the consumer may still hold (a pipeline's
#: in-flight batches) before the worker's next batches travel pickled instead
_SPARE_SLOTS = 4
#: mmap.MAP_NORESERVE (Python < 3.12 lacks it: Linux's value on x86-64 and arm64, where it is 0x4000;
#: none elsewhere, where the flag has other values: a shared anonymous mapping takes memory only as
#: its pages are written either way)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if os.uname().sysname == "Linux"
                         and os.uname().machine in ("x86_64", "aarch64") else 0)
#: worker pids not reaped yet, killed at interpreter exit if an iterator was never closed
_LIVE: "weakref.WeakSet[_Workers]" = weakref.WeakSet()


class WorkerError(ProcessFailure):
    """A loader worker process died (killed by a signal, or exited), made no batch in
    :data:`WORKER_STALL_S`, or was stopped for ``$DLRMCTL_STALL_TIMEOUT_S``: one ``error:`` line,
    exit 1 (:class:`~dlrmctl.errors.ProcessFailure`)."""


def auto_workers(device: torch.device | str, local_world_size: int = 1, cpus: int | None = None) -> int:
    """Workers for ``data.workers: auto``: none on a CPU run (the step's kernels use the cores
    and release the GIL, the loader thread keeps up), else the CPUs of this process's affinity
    shared by the ranks of the host, less one for the rank itself, at most
    :data:`MAX_AUTO_WORKERS` (0 when a rank has fewer than 2 CPUs).

    Args:
        device: the device of the rank's step.
        local_world_size: ranks on this host sharing its CPUs.
        cpus: CPUs available (default: ``len(os.sched_getaffinity(0))``).
    """
    if torch.device(device).type == "cpu":
        return 0
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(MAX_AUTO_WORKERS, cpus // max(1, local_world_size) - 1))


def _slot_bytes(loader: "BatchLoader") -> int:
    """Bytes of one slot: 4x a one-hot batch of this rank's rows (bags at their expanded size),
    at least 16 MiB; address space only until written (the mapping is MAP_NORESERVE)."""
    rows = -(-loader.batch_size // loader.world_size)
    ids = sum(loader.expand[f][1] if f in loader.expand else (16 if loader.multi_hot[f] else 1)
              for f in loader.features)
    per_row = 4 * len(loader.dense_names) + 4 + 20 * ids + 8 * len(loader.features)
    return -(-max(16 << 20, 4 * rows * per_row) // mmap.PAGESIZE) * mmap.PAGESIZE


def _arrays(b: Batch) -> list[np.ndarray | None]:
    kjt = b.sparse_features
    w = kjt.weights_or_none()
    return [t.numpy() if t is not None else None
            for t in (b.dense_features, b.labels, kjt.values(), kjt.lengths(), w)]


def _describe(b: Batch) -> tuple:
    kjt = b.sparse_features
    return kjt.keys(), kjt.stride(), kjt.length_per_key_or_none()


def _worker_main(loader: "BatchLoader", k: int, n: int, start: int, conn: connection.Connection,
                 ring: mmap.mmap, slot: int, credits: Any, free: list[Any], first: int) -> None:
    """Body of worker ``k`` of ``n`` (in the forked child): make batches ``i >= start`` with
    ``i % n == k`` and send each once it holds one of ``credits`` (a semaphore: at most its
    initial value, the depth, ahead of the consumer; blocking while it has none), into a slot of
    ``ring`` whose semaphore in ``free`` (slots ``first, first + 1, ...``) it could take (pickled
    over ``conn`` when none is free or the batch is larger than a slot); never returns."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        torch.set_num_threads(1)
        parent = os.getppid()
        loader.pin_memory = False  # pinned in the consumer (this process never touches CUDA)
        for i, b in loader._part(start, k, n):
            while not credits.acquire(timeout=_POLL_S):  # as far ahead as allowed: wait for the consumer
                if os.getppid() != parent:
                    return
            arrays = _arrays(b)
            sizes = [0 if a is None else -(-a.nbytes // _ALIGN) * _ALIGN for a in arrays]
            s = None
            if sum(sizes) <= slot:
                s = next((first + j for j, sem in enumerate(free) if sem.acquire(False)), None)
            if s is None:  # pickled over the socket (the consumer holds every slot, or it does not fit)
                conn.send(("inline", i, None, arrays, _describe(b)))
                continue
            at, layout = s * slot, []
            for a, size in zip(arrays, sizes):
                if a is None:
                    layout.append(None)
                    continue
                np.copyto(np.frombuffer(ring, a.dtype, a.size, at).reshape(a.shape), a)
                layout.append((at, a.dtype.str, a.shape))
                at += size
            conn.send(("slot", i, s, layout, _describe(b)))
    except BaseException as e:  # handed to the consumer, which raises it
        code = 1
        tb = traceback.format_exc()
        try:  # the consumer raises the same error (a UserError stays one error line), else its text
            same = pickle.loads(pickle.dumps(e))
            if type(same) is not type(e) or str(same) != str(e):
                raise TypeError
        except Exception:  # a user error stays one (its class may not travel), anything else its text
            e = UserError(str(e)) if isinstance(e, UserError) else RuntimeError(f"{type(e).__name__}: {e}")
        try:
            conn.send(("error", -1, -1, e, tb))
        except BaseException:
            pass
    finally:
        os._exit(code)


class _Workers:
    """The ``n`` forked workers of one iteration over ``loader`` from global batch ``start``."""

    def __init__(self, loader: "BatchLoader", start: int, n: int, depth: int) -> None:
        self.n, self.depth, self.slot = n, depth, _slot_bytes(loader)
        self.slots = depth + _SPARE_SLOTS
        self.pin = loader.pin_memory
        try:  # a worker stopped (SIGSTOP, a debugger) this long is named, as a stopped rank is
            self.stall_limit_s = stall_limit_s()
        except ValueError as e:
            raise CommandError(str(e)) from None
        self._stopped_since: dict[int, float] = {}  # worker -> when first seen stopped
        self._states_at = 0.0  # when the workers' states were last read
        self.ring = mmap.mmap(-1, n * self.slots * self.slot, flags=mmap.MAP_SHARED | _MAP_NORESERVE)
        fork = multiprocessing.get_context("fork")  # inherited by the forked workers
        #: per worker, the batches it may still send before the consumer receives one
        self.credits = [fork.Semaphore(depth) for _ in range(n)]
        #: per slot (worker k owns ``k * slots ...``), posted while it is free
        self.free = [fork.BoundedSemaphore(1) for _ in range(n * self.slots)]
        self.conns: list[connection.Connection] = []
        self.pids: list[int] = []
        _LIVE.add(self)
        try:
            for k in range(n):
                mine, theirs = connection.Pipe(duplex=True)
                with warnings.catch_warnings():  # 3.12+: fork of a process with threads (the child
                    warnings.simplefilter("ignore", DeprecationWarning)  # only runs numpy and this loop)
                    pid = os.fork()
                if pid == 0:
                    mine.close()
                    mine_at = k * self.slots
                    _worker_main(loader, k, n, start, theirs, self.ring, self.slot, self.credits[k],
                                 self.free[mine_at:mine_at + self.slots], mine_at)
                theirs.close()
                self.conns.append(mine)
                self.pids.append(pid)
        except BaseException:
            self.close()
            raise

    def _dead(self, k: int) -> str | None:
        """Why worker ``k`` is gone, or None while it runs."""
        if self.pids[k] <= 0:
            return "exited"
        try:
            pid, status = os.waitpid(self.pids[k], os.WNOHANG)
        except ChildProcessError:
            return "exited (already reaped)"
        if pid == 0:
            return None
        self.pids[k] = -1
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            return f"was killed by signal {sig} ({signal.Signals(sig).name})"
        return f"exited with code {os.WEXITSTATUS(status)}"

    def _check_stopped(self, now: float) -> None:
        """Every :data:`dlrmctl.stall_watch.POLL_S` s (while the consumer waits): the workers'
        ``/proc`` states; one stopped or blocked (:data:`dlrmctl.stall_watch.STALLED_STATES`) for
        ``stall_limit_s`` s in a row (0: never) kills them all.

        Raises:
            WorkerError: names the worker, its pid, its state and for how long."""
        if self.stall_limit_s <= 0 or now - self._states_at < _STATE_POLL_S:
            return
        self._states_at = now
        for k, pid in enumerate(self.pids):
            st = proc_stat(pid) if pid > 0 else None
            if st is None or st[0] not in STALLED_STATES:
                self._stopped_since.pop(k, None)
                continue
            seconds = now - self._stopped_since.setdefault(k, now)
            if seconds >= self.stall_limit_s:
                self.close()
                raise WorkerError(f"loader worker {k} of {self.n} (pid {pid}) has been {STALLED_STATES[st[0]]} for "
                                  f"{seconds:.0f} s; the run was stopped (${ENV_LIMIT} sets the limit, 0 turns "
                                  "the watchdog off)")

    def _died(self, k: int, pid: int, why: str, i: int) -> WorkerError:
        return WorkerError(f"loader worker {k} of {self.n} (pid {pid}) {why} before making batch {i + 1}; if it "
                           "was killed for memory, lower data.workers or data.shuffle_window_rows")

    def get(self, i: int) -> Batch:
        """Global batch ``i`` (the next one of worker ``i % n``).

        Raises:
            WorkerError: the worker died before sending it, or a worker stopped for the stall limit
                (names the worker, pid and cause).
            Exception: what the worker raised making it."""
        k = i % self.n
        conn, pid = self.conns[k], self.pids[k]
        since = time.monotonic()
        while not conn.poll(_POLL_S):
            self._check_stopped(time.monotonic())
            why = self._dead(k)
            if why is None and time.monotonic() - since > WORKER_STALL_S:
                self.close()
                raise self._died(k, pid, f"made no batch in {WORKER_STALL_S:g} s (stuck; killed)", i)
            if why is not None and not conn.poll(0):
                raise self._died(k, pid, why, i)
        try:
            kind, got, s, payload, desc = conn.recv()
        except (EOFError, OSError):  # its end of the socket closed (or reset): it is exiting, or exited
            why = None
            for _ in range(50):  # up to 5 s for its exit status
                why = self._dead(k)
                if why is not None:
                    break
                time.sleep(_POLL_S)
            raise self._died(k, pid, why or "closed its connection", i) from None
        if kind == "error":
            payload.add_note(f"(in loader worker {k} of {self.n}, pid {pid}:)\n{desc}")
            raise payload
        if got != i:
            raise RuntimeError(f"internal error: loader worker {k} sent batch {got + 1}, expected {i + 1}")
        if kind == "inline":
            tensors = [None if a is None else torch.from_numpy(a) for a in payload]
        else:
            tensors = self._slot_tensors(s, payload)
        self.credits[k].release()  # worker k may send one more
        dense, labels, values, lengths, weights = tensors
        keys, stride, lpk = desc
        kjt = KeyedJaggedTensor(keys, values, lengths=lengths, weights=weights, stride=stride, validate=False,
                                length_per_key=lpk)
        return Batch(dense, kjt, labels)

    def _slot_tensors(self, s: int, layout: list) -> list[torch.Tensor | None]:
        """The arrays of slot ``s`` as tensors.  Pinning: copies in pinned memory, and the slot is
        free at once.  Else tensors that view the slot (no copy), which is free again once every
        one of them, and every view of them, is gone: they all view one ``ctypes`` array of the
        slot, whose finalizer posts the slot's semaphore (from whichever thread drops it; a post
        never blocks, also after the workers are gone)."""
        base = s * self.slot
        view = (ctypes.c_char * self.slot).from_buffer(self.ring, base)
        out = [None if p is None else torch.from_numpy(
            np.frombuffer(view, np.dtype(p[1]), int(np.prod(p[2])), p[0] - base).reshape(p[2])) for p in layout]
        if self.pin:
            out = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in out]
            del view
            self.free[s].release()
            return out
        fin = weakref.finalize(view, self.free[s].release)
        fin.atexit = False
        return out

    def close(self) -> None:
        """Kill and reap every worker (they hold nothing but their memory), and close the sockets
        (the slots are unmapped with the last reference).  Idempotent."""
        for k, pid in enumerate(self.pids):
            if pid > 0:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
                self.pids[k] = -1
        for c in self.conns:
            c.close()
        self.conns = []
        _LIVE.discard(self)


def worker_batches(loader: "BatchLoader", start: int, n: int, depth: int) -> Iterator[Batch]:
    """The global batches ``start, start + 1, ...`` of ``loader``'s epoch, made by ``n`` forked
    workers, each at most ``depth`` batches ahead of the consumer (module docstring).

    Raises:
        WorkerError: a worker died; what a worker raised (e.g. DataError, EmbeddingIdError).
    """
    nb = loader.num_global_batches()
    if start >= nb:
        return
    pool = _Workers(loader, start, min(n, nb - start), depth)
    try:
        for i in range(start, nb):
            yield pool.get(i)
    finally:
        pool.close()


@atexit.register
def _kill_leftovers() -> None:
    for pool in list(_LIVE):
        pool.close()
