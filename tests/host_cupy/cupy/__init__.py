"""A stand-in for CuPy that runs the engine's CUDA backend on the host, for tests on a machine
without a GPU (CI): put `tests/host_cupy` first on `sys.path` of a separate process (never the
test process itself: the real CuPy's modules would be shadowed) and `import cupy` gives this.

What it is:
- device arrays are NumPy arrays of a subclass (`ndarray`) whose `.data.ptr` is their host
  address, so every kernel, copy and GEMM reads and writes them where the code put them;
- `RawModule` compiles the CUDA C with `tests.cuda_host.HostModule` (each CUDA thread a fiber, see
  there) and launches a kernel's blocks one after another; a kernel declared with
  `__cluster_dims__` runs its clusters' blocks together;
- `ElementwiseKernel` compiles its operation as a C++ loop over broadcast operands;
- `cupy_backends.cuda.libs.cublas` (beside this package) does cuBLAS's GemmEx and
  GemmStridedBatchedEx with NumPy on the raw pointers;
- copies (`cuda.runtime.memcpyAsync`) are `memmove`s; streams and events keep no queue, since
  every operation is done when its call returns;
- a stream capture records the launches, copies and GEMMs queued on that stream and a graph
  replays them; a NumPy operation on a device array during a capture raises (a graph of the real
  CuPy would have recorded it as a kernel, this one cannot), so code that captures array
  arithmetic must fall back or be switched off (the engine's prefill graphs:
  `EngineOptions.cupy_prefill_graph=False`).

`empty` fills with 0xFF bytes (NaN, -1), so a kernel reading memory nobody wrote shows; memory
hooks (`cuda.memory_hook.MemoryHook`) hear of every device array allocated, as a pool malloc.

The device it reports: `HOST_CUPY_SMS` multiprocessors (default 4, so grids stay small) of compute
capability `HOST_CUPY_CC` (default "87", the Orin's; "90" turns on the H200's clusters).
Not modelled: concurrency (blocks, streams), memory pools' accounting, PDL (`libcuda` is not
found, so the engine launches plainly), timing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from numpy import (  # noqa: F401 - the dtype names CuPy exports
    bool_,
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    uint8,
    uint16,
    uint32,
    uint64,
)

__version__ = "0.0-host"


class _Pointer:
    """An array's `.data`: its address as `ptr`."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def _guard() -> None:
    if _capturing() is not None:
        raise RuntimeError("host cupy: array arithmetic during a stream capture cannot be recorded")


class ndarray(np.ndarray):  # noqa: N801 - CuPy's name
    """A device array: host memory, its address as `.data.ptr`."""

    @property
    def data(self) -> _Pointer:  # type: ignore[override]
        return _Pointer(int(self.__array_interface__["data"][0]))

    def get(self) -> np.ndarray:
        return np.array(self)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        _guard()
        args = [np.asarray(a) if isinstance(a, ndarray) else a for a in inputs]
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(np.asarray(o) if isinstance(o, ndarray) else o for o in out)
        res = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _new(res) if isinstance(res, np.ndarray) else res

    def __array_finalize__(self, obj: Any) -> None:
        if obj is not None and self.flags.owndata:  # astype, copy: new memory, not a view
            _heard(self.nbytes)

    def __setitem__(self, key: Any, value: Any) -> None:
        _guard()
        super().__setitem__(key, value)


def _dev(a: Any) -> ndarray:
    return a if isinstance(a, ndarray) else _new(np.asarray(a))


_hooks: list[Any] = []  # memory hooks entered (`cuda.memory_hook.MemoryHook`)


def _heard(nbytes: int) -> None:
    """A device allocation of `nbytes`, told to the memory hooks as a pool malloc."""
    for h in _hooks:
        h.malloc_preprocess(device_id=0, size=nbytes, mem_size=nbytes)


def _new(a: np.ndarray) -> ndarray:
    """`a` (freshly allocated) as a device array (`_heard`)."""
    _heard(a.nbytes)
    return a.view(ndarray)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return _new(np.zeros(shape, dtype, order))


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    """Filled with 0xFF bytes (NaN, -1), not zeros: a kernel that reads what nobody wrote shows."""
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return _new(np.full(n, 0xFF, dtype=np.uint8).view(np.dtype(dtype)).reshape(shape))


def full(shape: Any, fill_value: Any, dtype: Any = None) -> ndarray:
    return _new(np.full(shape, fill_value, dtype))


def array_equal(a: Any, b: Any) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def empty_like(a: Any, dtype: Any = None) -> ndarray:
    return empty(np.shape(a), dtype or a.dtype)


def zeros_like(a: Any, dtype: Any = None) -> ndarray:
    return zeros(np.shape(a), dtype or a.dtype)


def array(a: Any, dtype: Any = None, order: str = "K", copy: bool = True) -> ndarray:
    return _new(np.array(np.asarray(a), dtype=dtype, order=order, copy=True))


def asarray(a: Any, dtype: Any = None, order: str | None = None) -> ndarray:
    if isinstance(a, ndarray) and (dtype is None or a.dtype == np.dtype(dtype)):
        return a
    return _new(np.array(np.asarray(a), dtype=dtype, order=order or "K"))


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray) and a.flags.c_contiguous and (dtype is None or a.dtype == np.dtype(dtype)):
        return a
    return _new(np.ascontiguousarray(np.asarray(a), dtype=dtype))


def asnumpy(a: Any) -> np.ndarray:
    return np.array(a)


def concatenate(arrays: Any, axis: int = 0) -> ndarray:
    _guard()
    return _new(np.concatenate([np.asarray(a) for a in arrays], axis=axis))


def copyto(dst: ndarray, src: Any) -> None:
    _guard()
    np.copyto(np.asarray(dst), np.asarray(src))


def take(a: Any, indices: Any, axis: int | None = None) -> ndarray:
    _guard()
    return _new(np.take(np.asarray(a), np.asarray(indices), axis=axis))


def matmul(a: Any, b: Any) -> ndarray:
    _guard()
    return _new(np.matmul(np.asarray(a), np.asarray(b)))


def abs(a: Any) -> ndarray:  # noqa: A001 - CuPy's name
    _guard()
    return _new(np.abs(np.asarray(a)))


# --- kernels ---------------------------------------------------------------------------------------
def _cache_dir() -> Path:
    d = Path(os.environ.get("HOST_CUPY_CACHE") or Path(tempfile.gettempdir()) / "host_cupy")
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextmanager
def _build_folder(name: str) -> Iterator[Path]:
    """The cache folder `name` (`HOST_CUPY_CACHE`), locked across processes while building in it:
    another child may build the same source (`cuda_host.build` then loads the library as it is)."""
    import fcntl

    folder = _cache_dir() / name
    folder.mkdir(exist_ok=True)
    with open(folder / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield folder
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cxx() -> str:
    from tests.cuda_host import compiler

    cxx = compiler()
    if cxx is None:
        raise RuntimeError("host cupy: no C++ compiler (c++, g++ or clang++) on PATH")
    return cxx


_CLUSTER = re.compile(
    r"__cluster_dims__\(\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\)\s*(?:\w+(?:\((?:[^()]|\([^()]*\))*\))?\s+)*?(?!__)(\w+)\("
)
"""A kernel declared with cluster dims: its name after any other qualifiers (`__launch_bounds__((32 * 8))`;
CUDA's names begin with two underscores, no kernel's does)."""


def _clusters(src: str, cxx: str) -> dict[str, int]:
    """Blocks a cluster (along y) of every kernel declared with `__cluster_dims__`, macros expanded."""
    if "__cluster_dims__" not in src:
        return {}
    r = subprocess.run([cxx, "-E", "-P", "-x", "c++", "-"], input=src, capture_output=True, text=True, check=True)
    out = {}
    for m in _CLUSTER.finditer(r.stdout):
        x, y, z = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if x != 1 or z != 1:
            raise RuntimeError(f"host cupy: cluster dims ({x}, {y}, {z}) of {m.group(4)}: only (1, y, 1) is modelled")
        out[m.group(4)] = y
    return out


def _arg(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return a
    if isinstance(a, (np.integer, bool)):
        return int(a)
    if isinstance(a, np.floating):
        return float(a)
    return a


class _Function:
    """One kernel of a `RawModule`: `fn(grid, block, args, shared_mem=0)`."""

    def __init__(self, module: Any, name: str, cluster: int) -> None:
        self._module, self.name, self._cluster = module, name, cluster

    def __call__(self, grid: Any, block: Any, args: Any, shared_mem: int = 0, stream: Any = None) -> None:
        g = tuple(int(v) for v in (grid if isinstance(grid, tuple) else (grid,)))
        b = tuple(int(v) for v in (block if isinstance(block, tuple) else (block,)))
        if any(v != 1 for v in b[1:]):
            raise RuntimeError(f"host cupy: {self.name}: only 1-D blocks are modelled, got {b}")
        conv = tuple(_arg(a) for a in args)

        def run() -> None:
            self._module.launch(self.name, g, b[0], *conv, cluster=self._cluster)

        _queue(run, stream)


class RawModule:
    """CUDA C compiled for the host (`tests.cuda_host.HostModule`), cached by source."""

    _built: dict[str, Any] = {}
    _lock = threading.Lock()

    def __init__(self, code: str, options: Any = (), name_expressions: Any = None, **_: Any) -> None:
        from tests.cuda_host import HostModule

        key = hashlib.sha256(code.encode()).hexdigest()[:20]
        with RawModule._lock:
            if key not in RawModule._built:
                cxx = _cxx()
                with _build_folder(key) as folder:
                    RawModule._built[key] = (HostModule(folder, code, cxx, "module"), _clusters(code, cxx))
        self._host, self._cluster = RawModule._built[key]

    def get_function(self, name: str) -> _Function:
        if name not in self._host.kernels:
            raise KeyError(f"host cupy: no kernel {name!r} in the module")
        return _Function(self._host, name, self._cluster.get(name, 1))


_CTYPE = {
    "float32": "float",
    "float16": "_Float16",
    "float64": "double",
    "int8": "signed char",
    "int32": "int",
    "int64": "long long",
    "uint8": "unsigned char",
}


class ElementwiseKernel:
    """CuPy's elementwise kernel: `operation` (C) over the broadcast inputs, per element."""

    def __init__(self, in_params: str, out_params: str, operation: str, name: str = "kernel", **_: Any) -> None:
        self._in = [p.split() for p in in_params.split(",")]
        self._out = [p.split() for p in out_params.split(",")]
        self._op, self._name = operation, name
        self._lib: Any = None

    def _build(self) -> Any:
        from tests.cuda_host import build

        params = [f"const {_CTYPE[t]}* p_{n}" for t, n in self._in] + [f"{_CTYPE[t]}* p_{n}" for t, n in self._out]
        loads = " ".join(f"{_CTYPE[t]} {n} = p_{n}[i];" for t, n in self._in)
        decl = " ".join(f"{_CTYPE[t]} {n};" for t, n in self._out)
        stores = " ".join(f"p_{n}[i] = {n};" for _, n in self._out)
        src = (
            "#include <cmath>\n#include <math.h>\n"
            f'extern "C" void ew(long long count, {", ".join(params)}) {{\n'
            f"  for (long long i = 0; i < count; i++) {{ {loads} {decl} {{ {self._op}; }} {stores} }}\n}}\n"
        )
        with _build_folder(f"ew_{hashlib.sha256(src.encode()).hexdigest()[:20]}") as folder:
            lib = build(folder, src, _cxx(), self._name)
        lib.ew.restype = None
        return lib

    def __call__(self, *args: Any) -> Any:
        _guard()
        if self._lib is None:
            self._lib = self._build()
        ins = [np.asarray(a, dtype=t) for a, (t, _) in zip(args, self._in, strict=False)]
        outs = list(args[len(self._in) :])
        shape = np.broadcast_shapes(*[a.shape for a in ins], *[np.shape(o) for o in outs])
        flat = [np.ascontiguousarray(np.broadcast_to(a, shape)) for a in ins]
        res = [np.empty(shape, dtype=t) for t, _ in self._out]
        self._lib.ew(ctypes.c_longlong(int(np.prod(shape))), *[ctypes.c_void_p(a.ctypes.data) for a in flat + res])
        if not outs:
            got = [_new(r) for r in res]
        else:
            for o, r in zip(outs, res, strict=True):
                np.asarray(o)[...] = r
            got = [_dev(o) for o in outs]
        return got[0] if len(got) == 1 else tuple(got)


# --- streams, events, graphs ----------------------------------------------------------------------
_local = threading.local()


def _capturing(stream: Stream | None = None) -> list[Callable[[], None]] | None:
    """The ops being recorded on `stream` (the current one by default), None if not capturing."""
    return (stream or _current())._recording


def _queue(op: Callable[[], None], stream: Any = None) -> None:
    rec = _capturing(stream)
    if rec is None:
        op()
    else:
        rec.append(op)


class _Graph:
    def __init__(self, ops: list[Callable[[], None]]) -> None:
        self._ops = ops

    def launch(self, stream: Any = None) -> None:
        for op in self._ops:
            op()

    def upload(self, stream: Any = None) -> None:
        pass


_streams: dict[int, Any] = {}


def _stream_at(ptr: int | None) -> Stream:
    """The stream of a raw stream handle (0 / None: the null stream)."""
    return _streams.get(int(ptr or 0), _null)


class Stream:
    """A stream: operations on it are done when their call returns, or recorded while capturing."""

    _next = iter(range(1, 1 << 40))

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> None:
        self.ptr = 0 if null else next(Stream._next)
        self._recording: list[Callable[[], None]] | None = None
        _streams[self.ptr] = self

    def __enter__(self) -> Stream:
        _stack().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _stack().pop()

    def use(self) -> Stream:
        _stack()[:] = [self]
        return self

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record(self, event: Any = None) -> Any:
        return event or Event()

    def begin_capture(self, mode: Any = None) -> None:
        self._recording = []

    def end_capture(self) -> _Graph:
        ops, self._recording = self._recording or [], None
        return _Graph(ops)

    def is_capturing(self) -> bool:
        return self._recording is not None

    def done(self) -> bool:
        return True


_null = Stream(null=True)
Stream.null = _null  # type: ignore[attr-defined]


def _stack() -> list[Stream]:
    st = getattr(_local, "stack", None)
    if st is None:
        st = _local.stack = []
    return st


def _current() -> Stream:
    st = _stack()
    return st[-1] if st else _null


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    @property
    def done(self) -> bool:
        return True


class _Runtime:
    memcpyHostToHost, memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice, memcpyDefault = 0, 1, 2, 3, 4

    class CUDARuntimeError(RuntimeError):
        pass

    @staticmethod
    def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
        _queue(lambda: ctypes.memmove(int(dst), int(src), int(size)), _stream_at(stream))

    @staticmethod
    def memcpy(dst: int, src: int, size: int, kind: int) -> None:
        ctypes.memmove(int(dst), int(src), int(size))

    @staticmethod
    def getDeviceCount() -> int:  # noqa: N802 - CUDA's names
        return 1

    @staticmethod
    def getDeviceProperties(device: int) -> dict[str, Any]:  # noqa: N802
        cc = _cc()
        return {
            "name": b"host (tests/host_cupy)",
            "multiProcessorCount": _sms(),
            "major": cc // 10,
            "minor": cc % 10,
            "totalGlobalMem": 8 << 30,
            "sharedMemPerBlockOptin": 227 << 10,
        }

    @staticmethod
    def driverGetVersion() -> int:  # noqa: N802
        return 12060

    @staticmethod
    def runtimeGetVersion() -> int:  # noqa: N802
        return 12060

    @staticmethod
    def free(ptr: int) -> None:
        pass

    @staticmethod
    def memGetInfo() -> tuple[int, int]:  # noqa: N802
        return 8 << 30, 8 << 30

    @staticmethod
    def deviceSynchronize() -> None:  # noqa: N802
        pass


def _cc() -> int:
    return int(os.environ.get("HOST_CUPY_CC", "87"))


def _sms() -> int:
    return int(os.environ.get("HOST_CUPY_SMS", "4"))


class Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = int(device or 0)

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def use(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    @property
    def compute_capability(self) -> str:
        return str(_cc())

    @property
    def attributes(self) -> dict[str, int]:
        return {"MultiProcessorCount": _sms(), "ComputeCapabilityMajor": _cc() // 10}

    @property
    def mem_info(self) -> tuple[int, int]:
        return _Runtime.memGetInfo()


class Memory:
    def __init__(self, size: int) -> None:
        self._buf = np.zeros(max(1, int(size)), np.uint8)
        self.ptr = int(self._buf.ctypes.data)
        self.size = int(size)


class MemoryPointer:
    def __init__(self, mem: Memory, offset: int) -> None:
        self.mem, self.ptr = mem, mem.ptr + int(offset)


class MemoryPool:
    def __init__(self, allocator: Any = None) -> None:
        pass

    def malloc(self, size: int) -> MemoryPointer:
        return MemoryPointer(Memory(size), 0)

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0

    def free_bytes(self) -> int:
        return 0

    def free_all_blocks(self, stream: Any = None) -> None:
        pass

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        pass


class PinnedMemory:
    def __init__(self, size: int, flags: int = 0) -> None:
        self._buf = bytearray(max(1, int(size)))
        self.size = int(size)


def PinnedMemoryPointer(mem: PinnedMemory, offset: int) -> memoryview:  # noqa: N802 - CuPy's class name
    """Pinned host memory at `offset` of `mem`: a buffer NumPy can wrap (`np.frombuffer`)."""
    return memoryview(mem._buf)[int(offset) :]


def _alloc_pinned_memory(size: int) -> memoryview:
    return PinnedMemoryPointer(PinnedMemory(size), 0)


@contextmanager
def _using_allocator(allocator: Any = None) -> Iterator[None]:
    yield


def _get_current_stream(device: Any = None) -> Stream:
    return _current()


class MemoryHook:
    """A memory hook: while entered, `malloc_preprocess` hears of every device array allocated."""

    name = "host"

    def __enter__(self) -> MemoryHook:
        _hooks.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _hooks.remove(self)

    def malloc_preprocess(self, **kw: Any) -> None:
        pass

    def alloc_preprocess(self, **kw: Any) -> None:
        pass


class _MemoryHookModule:
    MemoryHook = MemoryHook


class _DeviceModule:
    Device = Device

    @staticmethod
    def get_cublas_handle() -> int:
        return 1


class _Cuda:
    runtime = _Runtime
    device = _DeviceModule
    memory_hook = _MemoryHookModule
    Device = Device
    Stream = Stream
    Event = Event
    Memory = Memory
    MemoryPointer = MemoryPointer
    MemoryPool = MemoryPool
    PinnedMemory = PinnedMemory
    PinnedMemoryPointer = PinnedMemoryPointer
    alloc_pinned_memory = staticmethod(_alloc_pinned_memory)
    using_allocator = staticmethod(_using_allocator)
    get_current_stream = staticmethod(_get_current_stream)

    @staticmethod
    def is_available() -> bool:
        return True


cuda = _Cuda


_default_pool = MemoryPool()  # no accounting: the memory hooks count allocations (`MemoryHook`)


def get_default_memory_pool() -> MemoryPool:
    return _default_pool


def get_default_pinned_memory_pool() -> MemoryPool:
    return _default_pool
