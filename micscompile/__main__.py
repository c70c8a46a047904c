"""``python -m micscompile <command>``: the ``micscompile`` command (``micscompile.cli.command``)."""

import sys

from micscompile.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
