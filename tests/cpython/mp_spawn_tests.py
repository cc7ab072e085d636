"""CPython's multiprocessing tests, built as ``test_multiprocessing_spawn`` does.

An importable module (not ``__main__``), as ``test.test_multiprocessing_spawn``
is: the test classes are then pickled by reference when a test passes one of
their methods to a child, in fiber-dask as in the stdlib (a class of
``__main__`` would travel by value, with the manager its tests store on it).

The ``WithThreads*`` classes are left out: they test ``multiprocessing.dummy``
(threads of this process), which fiber-dask does not replace.
"""

from __future__ import annotations

import test._test_multiprocessing as _tm

_tm.install_tests_in_module_dict(globals(), "spawn")
for _name in [n for n in globals() if n.startswith("WithThreads")]:
    del globals()[_name]
del _name
