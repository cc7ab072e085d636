"""``python -m fiber_dask.cli``: the ``fiber-dask`` command."""

from fiber_dask.cli import main

if __name__ == "__main__":
    main(prog_name="fiber-dask")
