"""C++ kernel names, demangled, and the type of each parameter: what a word is.

The driver names a kernel by its mangled C++ name (``cuFuncGetName``), and that name
carries every parameter's type: ``std::array<char*, 3ul>`` (an operand array: every entry a
pointer the kernel dereferences), ``OffsetCalculator<...>`` (sizes and strides: no
pointer), a closure (``{lambda(int)#1}``: layout known to the compiler alone). Provenance
reads each word of a kernel's argument block through this: a word is a pointer, not one,
or inside a type whose layout a name does not give (:func:`word_kinds`).

Demangling uses the C++ runtime's own ``__cxa_demangle`` (libstdc++, loaded by torch
already) through ``ctypes``: the exact rules of the compiler's ABI, no parser of ours.
Where it is missing, every struct parameter is opaque.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
from typing import Any

POINTER, SCALAR, OPAQUE = 1, 0, 2
"""What one 8-byte word of a kernel's argument block is: a pointer the kernel uses, a
value that is not one, or not known from the types (a closure, an unknown struct)."""

_CXA: Any = None
_FREE: Any = None
_TRIED = False


def _runtime() -> tuple[Any, Any]:
    global _CXA, _FREE, _TRIED
    if not _TRIED:
        _TRIED = True
        for lib in ("libstdc++.so.6", ctypes.util.find_library("stdc++"), "libc++.so.1"):
            if not lib:
                continue
            try:
                cxa = ctypes.CDLL(lib).__cxa_demangle
            except (OSError, AttributeError):
                continue
            cxa.restype = ctypes.c_void_p
            cxa.argtypes = [
                ctypes.c_char_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.POINTER(ctypes.c_int),
            ]
            free = ctypes.CDLL(None).free
            free.argtypes = [ctypes.c_void_p]
            _CXA, _FREE = cxa, free
            break
    return _CXA, _FREE


@functools.lru_cache(maxsize=8192)
def demangle(name: str) -> str:
    """``name`` demangled (``name`` itself when it is not a mangled C++ name, or when no C++
    runtime is there to demangle it)."""
    if not name.startswith("_Z"):
        return name
    cxa, free = _runtime()
    if cxa is None:
        return name
    status = ctypes.c_int(-1)
    ptr = cxa(name.encode(), None, None, ctypes.byref(status))
    if not ptr:
        return name
    try:
        return ctypes.string_at(ptr).decode(errors="replace") if status.value == 0 else name
    finally:
        free(ptr)


_OPEN, _CLOSE = "(<{[", ")>}]"


def param_types(signature: str) -> list[str] | None:
    """The top-level parameter types of a demangled function signature, in order; None
    when ``signature`` has no parameter list (a plain name: Triton's, cuBLAS's)."""
    s = signature.rstrip()
    if not s.endswith(")"):
        return None
    depth, start = 0, -1
    for i in range(len(s) - 1, -1, -1):
        c = s[i]
        if c in _CLOSE:
            depth += 1
        elif c in _OPEN:
            depth -= 1
            if depth == 0:
                start = i
                break
    if start <= 0:
        return None
    inner = s[start + 1 : -1]
    if inner.strip() in ("", "void"):
        return []
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for c in inner:
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    out.append("".join(cur).strip())
    return out


_SCALARS = re.compile(
    r"^(?:const )?(?:unsigned |signed )?(?:bool|char|short|int|long|long long|float|double|"
    r"__int128|unsigned|int\d+_t|uint\d+_t|size_t|c10::(?:Half|BFloat16|Float8_\w+|"
    r"complex<\w+>)|__half|__nv_bfloat16|at::(?:Half|BFloat16))(?: const)?$"
)
_NO_POINTER_TYPES = re.compile(
    r"^(?:const )?(?:at::native::)?(?:\w+::)*(?:OffsetCalculator|TrivialOffsetCalculator|"
    r"IntDivider|(?:memory::)?(?:Load|Store)With(?:out)?Cast)\b"
)
_POINTER_ARRAY = re.compile(
    r"^(?:const )?(?:std|at::detail|c10)::(?:array|Array)<(.+)\*, (\d+)\w*>"
)
_VALUE_ARRAY = re.compile(
    r"^(?:const )?(?:std|at::detail|c10)::(?:array|Array)<([\w: ]+), (\d+)\w*>"
)
_TENSOR_INFO = re.compile(r"^(?:const )?at::cuda::detail::TensorInfo<")
_PHILOX = re.compile(r"^(?:const )?at::PhiloxCudaState$")


def kind_of(ctype: str, size: int) -> list[int]:
    """Per 8-byte word of a parameter of C++ type ``ctype`` laid out in ``size`` bytes
    (aligned to 8), what each word is (:data:`POINTER`, :data:`SCALAR`, :data:`OPAQUE`)."""
    words = -(-size // 8)
    t = ctype.strip()
    if t.endswith("*") or t.endswith("* const") or t.endswith("*&"):
        return [POINTER] * words if size == 8 else [OPAQUE] * words
    if t.endswith("&"):  # a reference parameter is passed as a pointer
        return [POINTER] * words if size == 8 else [OPAQUE] * words
    if _SCALARS.match(t) or _NO_POINTER_TYPES.match(t):
        return [SCALAR] * words
    if t.startswith("enum ") or "::Scalar" in t:
        return [SCALAR] * words
    m = _POINTER_ARRAY.match(t)
    if m and int(m.group(2)) * 8 == size:
        return [POINTER] * words
    m = _VALUE_ARRAY.match(t)
    if m and _SCALARS.match(m.group(1).strip()):
        return [SCALAR] * words
    if _TENSOR_INFO.match(t):  # {T* data; I sizes[25]; I strides[25]; int dims}
        return [POINTER] + [SCALAR] * (words - 1)
    if _PHILOX.match(t):  # {seed: value or pointer; offset: value or pointer; ...}
        return [POINTER, POINTER] + [SCALAR] * (words - 2)
    return [OPAQUE] * words


def word_kinds(name: str, params: list[tuple[int, int]], width: int) -> tuple[bytes, bool]:
    """One byte per 8-byte word of a kernel's argument block of ``width`` bytes (what each
    word is, from the kernel's mangled ``name`` and its ``(offset, size)`` parameters), and
    whether the kernel is ATen's own (``at::native::``: every pointer it takes, operand
    arrays and closures included, is a tensor its op was handed or made). Without types
    in the name (Triton's, cuBLAS's kernels) a whole 8-byte parameter is a pointer and a
    larger one opaque. Any parameter smaller than 8 bytes or not 8-aligned holds no pointer
    (a pointer is 8-aligned in any struct). A word two parameters share takes the stronger
    claim (pointer over opaque over scalar)."""
    full = demangle(name)
    types = param_types(full)
    if types is not None and len(types) != len(params):
        types = None
    kinds = bytearray(width // 8)
    seen = bytearray(width // 8)
    rank = {SCALAR: 0, OPAQUE: 1, POINTER: 2}
    for i, (off, size) in enumerate(params):
        if off % 8 or size < 8:
            per = [SCALAR] * (-(-(off % 8 + size) // 8))
        elif types is not None:
            per = kind_of(types[i], size)
        else:
            per = [POINTER] if size == 8 else [OPAQUE] * (-(-size // 8))
        for j, k in enumerate(per):
            w = off // 8 + j
            if w < len(kinds) and (not seen[w] or rank[k] > rank[kinds[w]]):
                kinds[w], seen[w] = k, 1
    return bytes(kinds), full.startswith("void at::native::")


__all__ = ["OPAQUE", "POINTER", "SCALAR", "demangle", "kind_of", "param_types", "word_kinds"]
