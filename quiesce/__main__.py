"""``python -m quiesce ARGS``: the ``quiesce`` command line."""

from quiesce.tools.cli.main import main

raise SystemExit(main())
