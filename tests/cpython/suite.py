"""Runs the tests of :mod:`mp_spawn_tests`, one JSON line per outcome.

Run by :mod:`run` (not by pytest): as a plain script it tests the stdlib; under
``fiber-dask run --swap-multiprocessing`` (with ``fiber.run.swap-modules: [test,
mp_spawn_tests]``) the interpreter's ``test._test_multiprocessing`` imports
fiber_dask as ``multiprocessing`` and the same tests run against fiber-dask.

Each test's outcome is written to ``--out`` as soon as it is known, so that a
run that dies is still counted up to the test that killed it.  A test gets
``--timeout`` seconds (SIGALRM raises :class:`TestTimeout` in it); one stuck
where no signal handler runs ends the process 30 s later with every thread's
stack (faulthandler), and run.py goes on after it.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import time
import traceback
import unittest

import mp_spawn_tests

_teardown_module = mp_spawn_tests.tearDownModule


def _tear_down_module() -> None:
    # The suite's own tearDownModule stops the stdlib's resource tracker and
    # waits for it, which never ends while processes that inherited it live:
    # under fiber-dask, the embedded cluster's worker processes.  Close the
    # cluster first; and never let the teardown hang the run.
    faulthandler.dump_traceback_later(120, exit=True)
    if "fiber_dask" in sys.modules:
        from fiber_dask import swap

        if swap.active():
            import fiber_dask

            fiber_dask.shutdown()
    _teardown_module()


mp_spawn_tests.tearDownModule = _tear_down_module


class TestTimeout(BaseException):
    """Raised in a test that ran past its time limit (a BaseException so that
    the test's own ``except Exception`` does not swallow it)."""


def _on_alarm(signum, frame):
    raise TestTimeout("the test ran past its time limit")


def _classes(selected: list[str]) -> list[type]:
    found = []
    for name, obj in sorted(vars(mp_spawn_tests).items()):
        if not (isinstance(obj, type) and issubclass(obj, unittest.TestCase)):
            continue
        if obj.__module__ != mp_spawn_tests.__name__ or obj.__name__ != name:
            continue
        if selected and name not in selected:
            continue
        found.append(obj)
    return found


class _Result(unittest.TextTestResult):
    """Writes one JSON line per outcome and arms the per-test alarm."""

    def __init__(self, out, timeout, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._out = out
        self._timeout = timeout
        self._started = 0.0

    def _emit(self, **record):
        self._out.write(json.dumps(record) + "\n")
        self._out.flush()

    def _record(self, test, outcome, err=None, reason=None):
        tid = test.id()
        cls, _, name = tid.rpartition(".")
        cls = cls.rpartition(".")[2]
        detail = reason
        if err is not None:
            lines = traceback.format_exception(*err)
            detail = "".join(lines)[-3000:]
        if isinstance(test, unittest.case._SubTest):
            cls, _, name = test.test_case.id().rpartition(".")
            cls = cls.rpartition(".")[2]
            detail = f"{test._subDescription()}: {detail}"
        if not hasattr(test, "_testMethodName"):  # setUpClass/module error holder
            cls, name = _holder_class(test), "<fixture>"
        self._emit(
            event="result",
            cls=cls,
            test=name,
            outcome=outcome,
            seconds=round(time.monotonic() - self._started, 2),
            detail=detail,
        )

    def startTest(self, test):
        super().startTest(test)
        self._started = time.monotonic()
        self._emit(event="start", cls=type(test).__name__, test=test._testMethodName)
        signal.alarm(self._timeout)
        # A test stuck where no signal handler can run (C code holding the GIL):
        # dump every thread and exit; run.py records it and goes on.
        faulthandler.dump_traceback_later(self._timeout + 30, exit=True)

    def stopTest(self, test):
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        super().stopTest(test)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "pass")

    def addError(self, test, err):
        super().addError(test, err)
        outcome = "timeout" if issubclass(err[0], TestTimeout) else "error"
        self._record(test, outcome, err)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "fail", err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skip", reason=reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "xfail", err)

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "fail", reason="unexpected success")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            outcome = "fail" if issubclass(err[0], test.failureException) else "error"
            self._record(subtest, outcome, err)


def _holder_class(holder) -> str:
    # "setUpClass (__main__.WithManagerTestQueue)" -> WithManagerTestQueue
    text = str(holder)
    inside = text[text.find("(") + 1 : text.rfind(")")]
    return inside.rpartition(".")[2] or text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON-lines file to append to")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per test")
    parser.add_argument("--list", action="store_true", help="only list the tests")
    parser.add_argument("classes", nargs="*", help="test classes (default: all)")
    args = parser.parse_args()

    loader = unittest.TestLoader()
    classes = _classes(args.classes)
    with open(args.out, "a") as out:
        for cls in classes:
            names = loader.getTestCaseNames(cls)
            out.write(
                json.dumps({"event": "plan", "cls": cls.__name__, "tests": list(names)})
                + "\n"
            )
        out.flush()
        if args.list:
            return 0
        signal.signal(signal.SIGALRM, _on_alarm)
        suite = unittest.TestSuite(loader.loadTestsFromTestCase(c) for c in classes)
        runner = unittest.TextTestRunner(
            stream=sys.stderr,
            verbosity=2,
            resultclass=lambda *a, **k: _Result(out, args.timeout, *a, **k),
        )
        runner.run(suite)
        out.write(json.dumps({"event": "done"}) + "\n")
    # The tests are counted; an exit that hangs (a shutdown waiting on
    # something) is dumped to the log and ended rather than waited for.
    faulthandler.dump_traceback_later(60, exit=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
