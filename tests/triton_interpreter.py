"""Imported first by the scripts that run kernels under Triton's CPU interpreter (conftest.run_interpreted).

Triton's interpreter patches `triton.language` for a kernel's launch, and then again, walking the whole
module with `inspect.getmembers`, on every call of a `@triton.jit` helper from inside the kernel. Every
builtin is already patched by then, so those walks change nothing, but they took more than half the time
of an engine run through the interpreter (a one-row matmul program calls its helpers once per K tile).
Here a helper's call skips the walk when the languages it sees are patched already; a kernel's launch
still patches, and restores, as before. Where Triton's interpreter lacks these internals (another
release), nothing is changed and the kernels run as they did, only slower.
"""

from __future__ import annotations

import os
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton.language as tl
    from triton.runtime import interpreter

    _patch_lang = getattr(interpreter, "_patch_lang", None)
    _scope = getattr(interpreter, "_LangPatchScope", None)
    _is_builtin = getattr(tl.core, "is_builtin", None)

    if _patch_lang is not None and _scope is not None and _is_builtin is not None:
        _original_patch_lang = _patch_lang

        def _patch_lang_once(fn: Any) -> Any:
            langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
            if langs and not any(_is_builtin(getattr(lang, "load", None)) for lang in langs):
                return _scope()  # inside a kernel's launch: everything it sees is patched
            return _original_patch_lang(fn)

        interpreter._patch_lang = _patch_lang_once
