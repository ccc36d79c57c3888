"""HostParams: a compiled kernel's launch parameters kept in ctypes storage and written in place.

A call of a CuTeDSL-compiled function converts each Python argument into fresh ctypes storage
(signature checks, adapter lookups, casts): with the dispatch's arguments that took ~94 us a call
on a 2-core CI machine and ~115 us on an H200 machine's host, ten times the rest of the launch.
CuTeDSL reads an argument that implements its JitArgument protocol's `__c_pointers__` as it is,
so HostParams keeps the storage and the pointers once and a call only writes the values. A
HostParams stands in for one parameter (a number, a stream) or one launch struct (its fields in
order), at call time only: compile with the typed values (Int64, the dataclasses of
launch_args.py).

Mutable and not thread-safe. Each kernel's launcher (DispatchLaunch, CombineLaunch,
RejectLaunch) keeps its own, written right before its launch from the one thread that drives the
transport (the transport is not thread-safe either: its calls are collective and ordered); the
regions and control words, the same at every call, are one set that a transport's launchers
share (launcher.py, TransportParams). The launch
copies the values when it is issued (a CUDA graph captures them then), so the next write cannot
change a launch already made.
"""

from __future__ import annotations

import ctypes
import dataclasses

from cutlass import Float32, Int32, Int64

STREAM = "stream"  # a CUstream parameter: the stream's handle
_CTYPES = {
    Int32: ctypes.c_int32,
    Int64: ctypes.c_int64,
    Float32: ctypes.c_float,
    STREAM: ctypes.c_void_p,
}


class HostParams:
    """Storage for parameters of the given types (Int32, Int64, Float32 or STREAM), in order."""

    def __init__(self, *types) -> None:
        self._values = [_CTYPES[t]() for t in types]
        self._pointers = [ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in self._values]

    @classmethod
    def of(cls, struct) -> HostParams:
        """The fields of a launch struct (a dataclass instance of launch_args.py), holding its
        values: for a struct that is the same at every call."""
        fields = dataclasses.fields(struct)
        params = cls(*(f.type for f in fields))
        cast = {Int32: int, Int64: int, Float32: float}
        return params.set(*(cast[f.type](getattr(struct, f.name)) for f in fields))

    def set(self, *values) -> HostParams:
        """Write the values (as many as the types, in order); returns self for the call."""
        assert len(values) == len(self._values), (len(values), len(self._values))
        for storage, value in zip(self._values, values):
            storage.value = value
        return self

    def __c_pointers__(self) -> list[ctypes.c_void_p]:
        return self._pointers
