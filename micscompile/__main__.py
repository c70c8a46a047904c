"""``python -m micscompile <command>``: the ``micscompile`` command (``micscompile.cli``)."""

import sys

from micscompile.cli import main

if __name__ == "__main__":
    sys.exit(main())
