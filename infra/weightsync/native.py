"""C functions that numba kernels call directly: xxh3-128 (from the ``xxhash`` wheel) and zstd
decompression (the system ``libzstd``), so a whole sparse-frame decode is one ``nogil`` call.

Why: decoding a frame step by step takes ~6 Python-level calls (positions kernel, zstd, values
kernel, xxh3, compares), each dropping and retaking the GIL. With two decode threads the hand-offs
serialise them: on a 2-core VM two threads decoded the model no faster than one that way (36 vs
32 ms, ~600 voluntary context switches a fetch; two *processes* each kept their one-thread speed).
One native call per frame holds the GIL only to start it.

The symbols are looked up at import (``XXH3_128bits_dispatch`` is the x86-64 build's runtime-
dispatched AVX2/AVX-512 variant, as fast as ``xxhash.xxh3_128``; ``ZSTD_decompress`` from
``libzstd.so.1``) and registered with LLVM by name, so numba's on-disk cache stays valid across
processes. When either is missing (another platform, no libzstd), or ``DELTALOOP_NO_NATIVE=1``,
:data:`AVAILABLE` is False and the codec keeps its step-by-step path; the bytes are the same.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

AVAILABLE = False
ZSTD_ERROR_MIN = (1 << 64) - 200  # ZSTD_isError: codes are the top ~120 values of size_t

_XXH_SYMBOL = "XXH3_128bits_dispatch"
_ZSTD_SYMBOL = "ZSTD_decompress"


def _addresses() -> tuple[int, int] | None:
    """(xxh3-128, ZSTD_decompress) function addresses, or None when not both are available."""
    try:
        import xxhash._xxhash as xxmod

        xx = ctypes.CDLL(xxmod.__file__)
        hfn = getattr(xx, _XXH_SYMBOL)
        path = ctypes.util.find_library("zstd")
        if path is None:
            return None
        zs = ctypes.CDLL(path)
        zfn = getattr(zs, _ZSTD_SYMBOL)
        zs.ZSTD_versionNumber.restype = ctypes.c_uint
        if zs.ZSTD_versionNumber() < 10400:  # 1.4.0: every frame python-zstandard writes
            return None
    except (ImportError, OSError, AttributeError):
        return None
    return ctypes.cast(hfn, ctypes.c_void_p).value, ctypes.cast(zfn, ctypes.c_void_p).value


xxh3_128: Any = None
zstd_decompress: Any = None

if not os.environ.get("DELTALOOP_NO_NATIVE"):
    try:
        import llvmlite.binding as _llvm
        from llvmlite import ir as _ir
        from numba import types as _types
        from numba.core import cgutils as _cg
        from numba.extending import intrinsic as _intrinsic
    except ImportError:
        _addr = None
    else:
        _addr = _addresses()
    if _addr is not None:
        _llvm.add_symbol(_XXH_SYMBOL, _addr[0])
        _llvm.add_symbol(_ZSTD_SYMBOL, _addr[1])
        _i64 = _ir.IntType(64)
        _ptr = _ir.IntType(8).as_pointer()

        @_intrinsic
        def xxh3_128(typingctx: Any, addr: Any, nbytes: Any) -> Any:  # pragma: no cover (compiled)
            """``(low64, high64)`` of XXH3-128 (seed 0) of ``nbytes`` at address ``addr``."""
            sig = _types.UniTuple(_types.uint64, 2)(_types.uintp, _types.uintp)

            def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
                # XXH128_hash_t {u64 low, u64 high} comes back in two registers: LLVM's {i64, i64}
                fnty = _ir.FunctionType(_ir.LiteralStructType([_i64, _i64]), [_ptr, _i64])
                fn = _cg.get_or_insert_function(builder.module, fnty, _XXH_SYMBOL)
                r = builder.call(fn, [builder.inttoptr(args[0], _ptr), args[1]])
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(r, 0), builder.extract_value(r, 1)])

            return sig, codegen

        @_intrinsic
        def zstd_decompress(typingctx: Any, dst: Any, cap: Any, src: Any, n: Any) -> Any:  # pragma: no cover
            """``ZSTD_decompress(dst, cap, src, n)``: bytes written, or an error code >= ZSTD_ERROR_MIN."""
            sig = _types.uintp(_types.uintp, _types.uintp, _types.uintp, _types.uintp)

            def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
                fnty = _ir.FunctionType(_i64, [_ptr, _i64, _ptr, _i64])
                fn = _cg.get_or_insert_function(builder.module, fnty, _ZSTD_SYMBOL)
                return builder.call(fn, [builder.inttoptr(args[0], _ptr), args[1],
                                         builder.inttoptr(args[2], _ptr), args[3]])

            return sig, codegen

        AVAILABLE = True
