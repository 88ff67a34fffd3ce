"""bench/step_program.py's canonical HLO: names, metadata and the source locations do not change a hash, a
changed program does (what its main-vs-branch comparison of the step rests on)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.step_program import canonical, without_empty


def _compiled(fn, name: str) -> str:
    fn.__name__ = name  # the module's and the computations' names follow the function's
    return jax.jit(fn).lower(jax.ShapeDtypeStruct((8, 4), jnp.float32)).compile().as_text()


def test_only_a_changed_program_changes_the_canonical_text():
    def one(x):
        return jnp.sum(x * 2.0 + 1.0, axis=1)

    def same(y):  # the same program from other source lines, names and argument names
        z = y * 2.0
        return jnp.sum(z + 1.0, axis=1)

    def other(x):
        return jnp.sum(x * 3.0 + 1.0, axis=1)

    a, b, c = _compiled(one, "first"), _compiled(same, "second"), _compiled(other, "first")
    assert a != b  # the raw texts differ (names, metadata) ...
    assert canonical(a) == canonical(b)  # ... the programs do not
    assert canonical(a) != canonical(c)
    assert "first" not in canonical(a) and "metadata" not in canonical(a)


def test_programs_that_differ_only_by_empty_arrays_passed_through_compare_equal_without_them():
    """without_empty (--compare): a zero-size argument passed through to the outputs (an empty accumulator field)
    is left out, and the program without it compares equal; a changed computation still differs."""
    def with_empty(x, e):
        return jnp.sum(x * 2.0 + 1.0, axis=1), x * 0.5, e

    def without(x):
        return jnp.sum(x * 2.0 + 1.0, axis=1), x * 0.5

    def other(x, e):
        return jnp.sum(x * 3.0 + 1.0, axis=1), x * 0.5, e

    x, e = jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((1, 0, 2), jnp.uint32)
    text = lambda fn, *args: canonical(jax.jit(fn).lower(*args).compile().as_text())
    a, b, c = text(with_empty, x, e), text(without, x), text(other, x, e)
    assert a != b and without_empty(a)[2] > 0 == without_empty(b)[2]
    assert without_empty(a)[:2] == without_empty(b)[:2]
    assert without_empty(a)[:2] != without_empty(c)[:2]


def test_instructions_run_in_another_order_compare_equal_and_a_changed_operand_does_not():
    """reordered (--compare): ENTRY running two instructions that do not depend on each other in the other order (a
    schedule's tie, as two 2-device programs of bench/RESULTS.md 18f once the empty accumulator field was gone) is
    the same computation; the same instructions with one operand swapped are not, even of equal shapes."""
    from bench.step_program import reordered

    def text(*lines):
        return canonical("HloModule m\n\n%f (a: s32[]) -> s32[] {\n  ROOT %a = s32[] parameter(0)\n}\n\n"
                         "ENTRY %main (p: s32[], q: s32[]) -> (s32[], s32[], s32[4]) {\n"
                         "  %p = s32[] parameter(0)\n  %q = s32[] parameter(1)\n" + "\n".join(lines) + "\n}\n")

    copy, again, wide = "  %c = s32[] copy(%p)", "  %d = s32[] copy(%q)", "  %w = s32[4]{0} broadcast(%p), dimensions={}"
    root = "  ROOT %t = (s32[], s32[], s32[4]{0}) tuple(%c, %d, %w)"
    one, other = text(copy, again, wide, root), text(wide, again, copy, root)
    swapped = text(copy.replace("%p", "%q"), again.replace("%q", "%p"), wide, root)  # each copy of the other one
    (ha, ba, _), (hb, bb, _), (hc, bc, _) = (without_empty(t) for t in (one, other, swapped))
    assert ha == hb == hc and ba != bb and ba != bc
    assert reordered(ba, ba) == 0 and reordered(ba, bb) == 2
    assert reordered(ba, bc) is None
