"""Support code for the tests: helpers that tests import, never tests themselves.

``tests/`` is on ``sys.path`` (see ``conftest.py``), so a test imports these as
``from support.wait import wait_until``.
"""
