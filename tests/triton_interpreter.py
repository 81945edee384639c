"""A faster Triton interpreter for the kernel tests: one language patch per launch.

Under ``TRITON_INTERPRET=1`` triton 3.9's interpreter patches ``triton.language`` (its
builtins swapped for the interpreter's, found by ``inspect.getmembers`` over
``tl``, ``tl.tensor`` and ``tl.math``) at every kernel launch, and again at every
call of a ``@triton.jit`` helper inside a kernel. The second patch finds nothing left
to swap (the launch's patch is in force until the launch ends), but its member scans
cost ~0.6 ms a call: the fused update calls ``fmix32`` four times per rounded row,
and those scans were 30% of the slowest kernel test (the bf16 Adam Hotline run:
95 s, 67 s with this).

It also hands a kernel its Python float arguments as fp32, as the compiled launch does
(the interpreter keeps them Python floats, so ``1.0 - beta2`` was exact there and
rounded on the GPU: 0.999 in fp32 is 1.3e-5 off in ``1 - beta2``, Adam's tables 3e-6
apart from torch's on the 2026-11-27 H200 and not here).

Two more costs of the interpreter's own, with nothing of the kernels' in them:
- ``_get_np_dtype`` builds a dict of 19 hashed types at each of its ~0.4 million
  calls in one static Hotline test; the answer is now found once per element type.
- Its integer-overflow sanitizer recomputes every int32 add, sub and mul in int64 with
  a range test, then drops the test (``device_assert`` checks only under ``debug``,
  which the interpreter's options never turn on). It is off where ``debug`` is off.
Together: the bf16 Adam Hotline test (``update_their_cold_rows[adam-bf16-mapped]``)
79 s -> 44 s alone, the kernels tests 942 -> 616 s of test time (2026-12-07).

``install()`` wraps the interpreter's ``_patch_lang``: where every language module the
helper sees is patched already (``load`` is no builtin), it returns an empty scope
(each helper module's language modules found once).
Nothing else changes: the same interpreted ops run. Tests only (the product never
interprets kernels); the kernel tests' torch references check the results. Another
triton without these names: left as it is.
"""

from __future__ import annotations

import inspect
import os


def install() -> bool:
    """Wrap the interpreter's patch (once per process); whether it is wrapped."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch, scope = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope is None or not hasattr(tl.core, "is_builtin"):
        return False
    if getattr(patch, "once_per_launch", False):
        return True
    _floats_as_fp32(interpreter, tl)
    _np_dtypes_cached(interpreter)
    _no_unchecked_overflow_sanitizer(interpreter)

    langs_of: dict[int, list] = {}  # a jit function's globals' language modules (its module's: fixed)

    def patch_once(fn):
        langs = langs_of.get(id(fn.__globals__))
        if langs is None:
            langs = langs_of[id(fn.__globals__)] = [v for v in fn.__globals__.values()
                                                    if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and all(not tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs):
            return scope()  # inside a launch: its patch holds
        return patch(fn)

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once
    return True


def _floats_as_fp32(interpreter, tl) -> None:
    """A Python float argument becomes an fp32 scalar, as a compiled kernel gets it."""
    convert, handle = getattr(interpreter, "_implicit_cvt", None), getattr(interpreter, "TensorHandle", None)
    if convert is None or handle is None:
        return
    import numpy as np

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(handle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    interpreter._implicit_cvt = implicit_cvt


def _np_dtypes_cached(interpreter) -> None:
    """The interpreter's numpy dtype of a Triton type, found once per type: it builds a
    19-entry dict of hashed types at every call (~0.4 million calls in one static Hotline
    test)."""
    find = getattr(interpreter, "_get_np_dtype", None)
    if find is None:
        return
    import numpy as np

    found: dict = {}
    address = np.dtype(np.uint64)

    def np_dtype(tt_dtype):
        scalar = tt_dtype.scalar  # a block's element type, a pointer itself: what the answer depends on
        if scalar.is_ptr():  # addresses (a pointer type is not hashable)
            return address
        try:
            return found[scalar]
        except KeyError:
            found[scalar] = value = find(scalar)
            return value

    interpreter._get_np_dtype = np_dtype


def _no_unchecked_overflow_sanitizer(interpreter) -> None:
    """Without ``debug`` the interpreter's integer-overflow sanitizer computes each int32
    add, sub and mul again in int64 with its range test, then drops the test
    (``device_assert`` does nothing unless ``debug``): a third of a bf16 kernel's ops,
    checking nothing. Off where ``debug`` is off (the interpreter's options never turn it
    on); an options object with ``debug`` set keeps it."""
    import dataclasses

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or getattr(options, "debug", True) or not hasattr(options, "sanitize_overflow"):
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
