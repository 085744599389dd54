"""``python -m pbs``: the ``pbs`` command line, for environments where the script is not on PATH
(or another ``pbs`` shadows it)."""

from pbs.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
