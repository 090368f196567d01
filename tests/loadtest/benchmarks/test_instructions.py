"""bench_instructions reads a callgrind dump's instruction count from callgrind_annotate's output."""

from __future__ import annotations

import pytest

from loadtest.benchmarks.instructions import program_totals

ANNOTATED = """--------------------------------------------------------------------------------
Profile data file 'callgrind.out.1' (creator: callgrind-3.19.0)
--------------------------------------------------------------------------------
Events recorded:  Ir
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
372,667,486 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                   file:function
--------------------------------------------------------------------------------
71,532,449 (19.19%)  Python/ceval.c:_PyEval_EvalFrameDefault [libpython3.11.so.1.0]
"""


def test_the_program_totals_line_gives_the_count():
    assert program_totals(ANNOTATED) == 372_667_486


def test_an_output_without_totals_is_an_error_not_zero():
    with pytest.raises(ValueError):
        program_totals(ANNOTATED.replace("PROGRAM TOTALS", "SOMETHING ELSE"))
