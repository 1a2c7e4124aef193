"""``python -m unison.cli``: the same as the ``unison`` command."""

from unison.cli import main

raise SystemExit(main())
