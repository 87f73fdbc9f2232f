"""`python -m sdsat`: the command line (see sdsat/cli.py)."""

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while Python imports the package: no traceback either
    raise SystemExit(130) from None

raise SystemExit(main())
