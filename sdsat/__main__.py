"""`python -m sdsat`: the command line (see sdsat/cli.py)."""

from .cli import main

raise SystemExit(main())
