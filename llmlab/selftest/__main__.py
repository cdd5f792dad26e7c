"""``python -m llmlab.selftest NAME [--quick] [--result PATH]``: one check in this process."""

import sys

from llmlab.selftest.runner import _main

sys.exit(_main(sys.argv[1:]))
