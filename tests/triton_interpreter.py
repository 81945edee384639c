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

``install()`` wraps the interpreter's ``_patch_lang``: where every language module the
helper sees is patched already (``load`` is no builtin), it returns an empty scope.
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

    def patch_once(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
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
