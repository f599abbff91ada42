"""``python -m cpkv ...`` is the ``cpkv`` command (see :mod:`cpkv.tools.cli`)."""

from cpkv.tools.cli import main

raise SystemExit(main())
