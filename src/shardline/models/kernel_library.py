"""The compiled kernels' library: every ``.c`` file of ``kernels/`` built into one shared
library with the system C compiler, once per machine (keyed by the sources, the compiler,
its flags and the CPU's features), kept in ``$XDG_CACHE_HOME/shardline/kernels/`` and
loaded with ctypes (:func:`kernels`; what each kernel does: :mod:`shardline.models.native_dequant`
and :mod:`shardline.models.fused_decode`, which call it). Where no compiler works,
:func:`kernels` is None and the eager torch code runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

from shardline.machine_cache import cache_dir

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = sorted(KERNELS.glob("*.c"))
"""Compiled together; they share ``kernels.h``."""
FLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]
TUNED_FLAGS = ["-march=native", "-fopenmp"]
"""Tried first (vector width of this CPU, and threads); the library is then keyed by the
CPU's flags. ``-fopenmp`` links ``libgomp.so.1``: torch's own copy, already loaded by
then, so the decode product's threads are torch's (``torch.set_num_threads``)."""

COMPILE_TIMEOUT_S = 120


_P = ctypes.c_void_p
_I = ctypes.c_int64


def _compiler() -> str:
    return os.environ.get("CC") or (sysconfig.get_config_var("CC") or "cc").split()[0]


def _cpu_key() -> str:
    """What a -march=native build depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "model name", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _library_path(flags: list[str]) -> Path:
    digest = hashlib.sha256()
    texts = [path.read_bytes() for path in sorted(KERNELS.glob("*.[ch]"))]
    for part in (*texts, _compiler().encode(), " ".join(flags).encode(), _cpu_key().encode()):
        digest.update(part)
    return cache_dir() / "kernels" / f"dequant-{digest.hexdigest()[:20]}.so"


def remove_stale_builds(directory: Path, now: float) -> list[Path]:
    """Delete the unfinished libraries (``*.so.tmp``) in ``directory`` older than
    :data:`COMPILE_TIMEOUT_S` (time.time() seconds ``now``): their builder was killed
    between compiling and renaming (a host-profile child stopped mid-start, say), and no
    build lasts longer. The paths deleted."""
    stale = []
    for leftover in directory.glob("*.so.tmp"):
        try:
            if now - leftover.stat().st_mtime > COMPILE_TIMEOUT_S:
                leftover.unlink()
                stale.append(leftover)
        except OSError:  # another process removed or renamed it
            continue
    return stale


def _build(flags: list[str]) -> Path:
    """The library built with ``flags`` (compiled now unless already in the cache).

    Raises:
        OSError, subprocess.SubprocessError: no compiler, or it failed.
    """
    path = _library_path(flags)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(path.parent, time.time())
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so.tmp", delete=False) as tmp:
        pass
    try:
        subprocess.run(
            [_compiler(), *flags, *map(str, SOURCES), "-o", tmp.name],
            check=True,
            capture_output=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        Path(tmp.name).replace(path)  # atomic: runners starting together each build, one wins
    finally:
        Path(tmp.name).unlink(missing_ok=True)
    return path


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None where they cannot be built (logged
    once)."""
    for flags in (FLAGS + TUNED_FLAGS, FLAGS + TUNED_FLAGS[:1], FLAGS):
        try:
            lib = ctypes.CDLL(str(_build(flags)))
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.debug("dequant kernels with %s: %s %s", flags, e, detail.decode(errors="replace"))
            continue
        declare(lib)
        return lib
    log.warning(
        "no C compiler could build %s: prefill dequantizes with torch ops (slower)",
        " ".join(path.name for path in SOURCES),
    )
    return None


def declare(lib: ctypes.CDLL) -> None:
    """Give ``lib``'s functions their C signatures. Every build defines every function
    (one built without the instructions a kernel needs has a stub that ``*_built()``
    says not to call).

    Raises:
        AttributeError: a function the build lacks.
    """
    for name in ("int4_planes_t_32", "int4_planes_t_16"):
        getattr(lib, name).argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _P, ctypes.c_int]
    _C = ctypes.c_int
    lib.int4_planes_gemv.argtypes = [_P, _P, _C, _I, _P]
    lib.int4_planes_rows.argtypes = [_P, _P, _P, _P, _I, _I, _I, _P, _P, _I, _P]
    lib.int4_planes_gemv_built.restype = ctypes.c_int
    lib.amx_tiles_ready.restype = ctypes.c_int
    lib.int4_planes_amx_prefill.argtypes = [_P, _P, _I, _P]
    lib.int8_groups.argtypes = [_P, _P, _P, _I, _I, _I, _P, ctypes.c_int]
    lib.int8_groups_gemv.argtypes = [_P, _P, _P, _I, _I, _I, _P, _P, _I, _P]
    lib.packed_groups_rows.argtypes = [_P, _P, _I, _P, _C, _P]
    lib.packed_groups_cols.argtypes = [_P, _P, _C]
    lib.packed_groups_gemv.argtypes = [_P, _P, _I, _P]
    lib.packed_groups_q8_gemv.argtypes = [_P, _P, _C, _I, _P]
    lib.packed_groups_q8_gemv.restype = ctypes.c_int
    lib.top_k_rows.argtypes = [_P, _I, _I, _I, _P]
    lib.top_k_rows.restype = ctypes.c_int
    lib.packed_groups_refine.argtypes = [_P, _P, _I, _P, _I, _P, _P]
    lib.packed_groups_refine.restype = ctypes.c_int
    lib.packed_groups_gemv.restype = ctypes.c_int
    lib.int4_pack_halves.argtypes = [_P, _I, _I, _C, _C, _I, _P, _C]
    lib.unpack_blocks.argtypes = [_P, _I, _I, _C, _P, _P, _P, _C]
    lib.pack_groups_bits.argtypes = [_P, _I, _I, _C, _P, _P, _C]
    lib.scales_zeros_bf16.argtypes = [_P, _P, _I, _I, _P, _I, _I, _C]
    lib.dense_gemv_built.restype = ctypes.c_int
    lib.dense_bf16_gemv.argtypes = [_P, _P, _I, _P]
    lib.dense_bf16_gemv.restype = ctypes.c_int
    lib.decode_layers_built.restype = ctypes.c_int
    lib.decode_layers.argtypes = [_P, _P, _I, _P, _I, _P, _P, _P, _P]
    lib.decode_layers.restype = ctypes.c_int
    lib.prefill_attention_built.restype = ctypes.c_int
    lib.prefill_attention.argtypes = [_P, _I, _I, _I, _P, _P, _I, _I, _I, _I, ctypes.c_float, _P]
    lib.prefill_attention.restype = ctypes.c_int


def loaded() -> ctypes.CDLL:
    """:func:`kernels`, which the caller has checked are built.

    Raises:
        RuntimeError: they are not.
    """
    lib = kernels()
    if lib is None:
        raise RuntimeError("dequant kernels are not available")
    return lib
