"""``python -m kproxy``: the same command line as the ``kproxy`` script."""

import sys

from kproxy.cli import main

sys.exit(main())
