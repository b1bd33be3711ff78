"""Every supported specialization of every kernel, and the covering set CI compiles.

``all_specs`` is the full product of each kernel's axes (``cupaged-bench compile --all``:
thousands of NVRTC compiles, the check to run after changing a kernel template or a
geometry mirror). ``covering_specs`` is what the test suite compiles: per kernel, a
pairwise covering array over its axes and the targets (every value of every axis, and
every pair of values of any two axes, at least once), plus each target's largest and
smallest shared-memory decode specializations. Constraints that no compile of a subset
can prove for all (shared memory, static_asserts) are checked for every specialization by
their host mirrors (``_geometry``), which needs no compiler.
"""

from __future__ import annotations

from itertools import product

from . import _checks, _covering, _dtypes, _geometry, jit

GROUP_TILES = (1, 2, 4, 8)

# Each kernel's template axes (its KernelSpec fields) and their supported values.
AXES = {
    "paged_decode": {"dtype": tuple(_dtypes.BY_NAME), "head_size": _checks.HEAD_SIZES,
                     "block_size": _checks.BLOCK_SIZES, "group_tile": GROUP_TILES},
    "paged_decode_combine": {"dtype": tuple(_dtypes.BY_NAME), "head_size": _checks.HEAD_SIZES},
    "reshape_and_cache": {"dtype": tuple(_dtypes.BY_NAME), "index_dtype": ("i32", "i64")},
    "copy_blocks": {"index_dtype": ("i32", "i64")},
}


def all_specs(archs) -> list[jit.KernelSpec]:
    """The full product: every supported specialization of every kernel, every target."""
    specs = []
    for kernel, axes in AXES.items():
        for arch in archs:
            for values in product(*axes.values()):
                specs.append(jit.KernelSpec(kernel, arch=arch, **dict(zip(axes, values))))
    return specs


def _decode_path(spec) -> tuple:
    """What selects the code a decode specialization compiles: its element type, its tile
    and group tile, and the branches DecodeGeometry derives from several axes at once
    (tensor cores, V's shared-memory layout), which pairs of axes alone may miss."""
    g = _geometry.DecodeGeometry.of(spec)
    return spec.dtype, spec.tile_tokens, spec.group_tile, g.mma, g.v_transposed


def covering_specs(archs) -> list[jit.KernelSpec]:
    """A pairwise covering set over each kernel's axes and ``archs``; plus, for each
    target, one decode specialization of every code path (``_decode_path``) the pairs did
    not reach and the ones with the most and the least shared memory."""
    specs = []
    for kernel, axes in AXES.items():
        for row in _covering.pairwise({**axes, "arch": tuple(archs)}):
            specs.append(jit.KernelSpec(kernel, **row))
    for arch in archs:
        decode = [s for s in all_specs([arch]) if s.kernel == "paged_decode"]
        reached = {_decode_path(s) for s in specs if s.kernel == "paged_decode" and s.arch == arch}
        for s in decode:
            if _decode_path(s) not in reached:
                reached.add(_decode_path(s))
                specs.append(s)
        smem = [_geometry.DecodeGeometry.of(s).smem_bytes for s in decode]
        specs.append(decode[smem.index(max(smem))])
        specs.append(decode[smem.index(min(smem))])
    return list(dict.fromkeys(specs))
