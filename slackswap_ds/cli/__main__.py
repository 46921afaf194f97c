"""``python -m slackswap_ds.cli``: the ``slackswap`` command."""

from . import main

raise SystemExit(main())
