"""Costs of Triton's interpreter (TRITON_INTERPRET=1) that compute nothing, removed for the tests.

- A call of a ``@triton.jit`` device function (``tl.sum``, ``tl.max``, ``tl.cdiv`` are such functions too)
  re-patches ``triton.language`` each time: ``_patch_lang`` walks every member of ``tl``, ``tl.core``,
  ``tl.math`` and ``tl.tensor`` with ``inspect.getmembers`` (a quarter of a chunk kernel's interpreted time).
  Within one launch the first call from a module does it; every later call from that module finds each builtin
  already patched (the launch restores them only when it ends) and sets the same attributes to equivalent
  functions again. Only those later calls are skipped.
- ``_get_np_dtype`` builds its table of 19 dtypes on every call: its answer per element dtype is kept.
- The interpreter's builder makes a new ``tl.block_type`` (shape unwrapped and validated) for every value an
  op returns: one per element type and shape is kept (a block type holds nothing but those two).

Together they take 35-45% off the interpreted kernels' CPU time. What the kernels compute is untouched
(tests/kernels/test_interpreter_speedups.py: bit for bit against Triton's own functions, put back by
``triton_originals()``). ``install()`` applies them only to the interpreter source they were checked against
(a hash of the replaced functions' source): another Triton runs unchanged, and that test says so.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect

CHECKED_SOURCE = "98ba9d788382f44a"  # triton 3.9.0

_launch_patched: list[set[int]] = []  # per running launch (innermost last): ids of the globals already patched
_np_dtypes: dict = {}
_block_types: dict = {}
_originals: dict = {}  # (owner, attribute) -> Triton's own, once installed
skipped_patches = 0  # device function calls that found triton.language patched already


def _interpreter():
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    return interpreter


def source_hash(interpreter) -> str:
    functions = (interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__,
                 interpreter._get_np_dtype, interpreter.InterpreterBuilder.get_block_ty, interpreter.tl.block_type)
    return hashlib.sha256("".join(inspect.getsource(f) for f in functions).encode()).hexdigest()[:16]


def installed() -> bool:
    return bool(_originals)


def install() -> bool:
    """Applies the speed-ups when Triton's interpreter is the checked one; True when applied."""
    interpreter = _interpreter()
    if interpreter is None or source_hash(interpreter) != CHECKED_SOURCE:
        return installed()
    if installed():
        return True
    launch = interpreter.GridExecutor.__call__
    patch_lang, np_dtype = interpreter._patch_lang, interpreter._get_np_dtype
    make_block_type = interpreter.InterpreterBuilder.get_block_ty
    block_type, pointer_type = interpreter.tl.block_type, interpreter.tl.pointer_type
    error = interpreter.InterpreterError

    def grid_call(self, *args, **kwargs):
        _launch_patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launch_patched.pop()

    def device_call(self, *args, **kwargs):
        # This is a device function call: as Triton's, minus the repeated patching.
        global skipped_patches
        key = id(self.fn.__globals__)
        if not _launch_patched or key not in _launch_patched[-1]:
            patch_lang(self.fn)
            if _launch_patched:
                _launch_patched[-1].add(key)
        else:
            skipped_patches += 1
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    def get_np_dtype(tt_dtype):
        # Triton's answer for a block is its element's; for any pointer, uint64
        if isinstance(tt_dtype, block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, pointer_type):
            return np_dtype(tt_dtype)
        try:
            return _np_dtypes[tt_dtype]
        except KeyError:
            result = _np_dtypes[tt_dtype] = np_dtype(tt_dtype)
            return result

    def get_block_ty(self, dtype, shape):
        try:
            key = (dtype, tuple(shape))
            return _block_types[key]
        except TypeError:  # a pointer element type is not hashable: made each time, as before
            return make_block_type(self, dtype, shape)
        except KeyError:
            result = _block_types[key] = make_block_type(self, dtype, shape)
            return result

    for owner, name, new in ((interpreter.GridExecutor, "__call__", grid_call),
                             (interpreter.InterpretedFunction, "__call__", device_call),
                             (interpreter, "_get_np_dtype", get_np_dtype),
                             (interpreter.InterpreterBuilder, "get_block_ty", get_block_ty)):
        _originals[owner, name] = getattr(owner, name)
        setattr(owner, name, new)
    return True


@contextlib.contextmanager
def triton_originals():
    """Triton's own functions in place of the speed-ups for the duration."""
    replaced = {key: getattr(*key) for key in _originals}
    try:
        for (owner, name), original in _originals.items():
            setattr(owner, name, original)
        yield
    finally:
        for (owner, name), new in replaced.items():
            setattr(owner, name, new)
