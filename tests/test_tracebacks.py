"""Tracebacks of code sent by value name its real file and line (not
cloudpickle's ``<dynamic-code>``), in a child Process as in this process."""

from __future__ import annotations

import pickle
import sys
import traceback

import cloudpickle
import pytest

import fiber_dask  # noqa: F401  (installs the code reducer)

pytestmark = pytest.mark.timeout(90)


def _by_value_function(path):
    path.write_text("def fails():\n    return 1 / 0  # MARKER\n")
    code = compile(path.read_text(), str(path), "exec")
    namespace = {"__name__": "__main__", "__file__": str(path)}
    exec(code, namespace)
    return namespace["fails"]  # of "__main__": cloudpickle sends it by value


def test_code_sent_by_value_keeps_its_file_name(tmp_path):
    fails = _by_value_function(tmp_path / "script.py")
    copy = pickle.loads(cloudpickle.dumps(fails))
    assert copy is not fails
    with pytest.raises(ZeroDivisionError) as info:
        copy()
    text = "".join(traceback.format_tb(info.value.__traceback__))
    assert f'File "{tmp_path / "script.py"}", line 2' in text
    assert "1 / 0  # MARKER" in text


def write_traceback(path, fails):
    sys.stderr = open(path, "w")  # noqa: SIM115 - the child's stderr, kept open
    fails()


def test_a_childs_traceback_names_the_real_file(fiber_ctx, tmp_path):
    fails = _by_value_function(tmp_path / "script.py")
    err = tmp_path / "err.txt"
    p = fiber_ctx.Process(target=write_traceback, args=(str(err), fails))
    p.start()
    p.join(60)
    assert p.exitcode == 1
    text = err.read_text()
    assert "script.py" in text and "1 / 0  # MARKER" in text, text
    assert "<dynamic-code>" not in text
