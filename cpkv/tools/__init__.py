"""The user's tools on top of the library: the ``cpkv`` command line, the demo, the
scaling benchmark and its synthetic workloads."""
