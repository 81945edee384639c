"""A faster Triton interpreter for the kernel tests: one language patch per launch.

Under ``TRITON_INTERPRET=1`` triton 3.9's interpreter patches ``triton.language`` (its
builtins swapped for the interpreter's, found by ``inspect.getmembers`` over
``tl``, ``tl.tensor`` and ``tl.math``) at every kernel launch, and again at every
call of a ``@triton.jit`` helper inside a kernel. The second patch finds nothing left
to swap (the launch's patch is in force until the launch ends), but its member scans
cost ~0.6 ms a call: the fused update calls ``fmix32`` four times per rounded row,
and those scans were 30% of the slowest kernel test (the bf16 Adam Hotline run:
95 s, 67 s with this).

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

    def patch_once(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and all(not tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs):
            return scope()  # inside a launch: its patch holds
        return patch(fn)

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once
    return True
