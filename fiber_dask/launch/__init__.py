"""A Process on a worker host: the launcher beside the Dask tasks, the child's
start-up, and the ``__main__`` the child sees."""
