"""Functions the tests run inside workers, slot processes and children.

Each module serves the test file its docstring names.  They live in a package
on ``sys.path`` and ``PYTHONPATH`` (see ``conftest.py``) because the stdlib
oracle's children, like fiber-dask's slot processes and Dask workers, import a
pickled function by its module's name; the harness the tests drive (clusters,
network namespaces, the Kubernetes API) is in ``support/``.
"""
