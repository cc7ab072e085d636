"""What keeps fiber-dask out of the state of the processes it runs in: who
takes a terminal's Ctrl-C, Dask's random draws kept off the program's
``random``, and the resource tracker a task process shares."""
