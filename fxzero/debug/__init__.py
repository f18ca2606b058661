"""Seeing what fxzero did: graph dumps (:mod:`.dump`), :func:`fxzero.explain` (:mod:`.explain`,
rendered by :mod:`.explain_format`) and the ``python -m fxzero`` command line (:mod:`.cli`,
its TARGETs loaded by :mod:`.target`)."""
