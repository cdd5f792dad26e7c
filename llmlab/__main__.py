"""``python -m llmlab`` is the ``llmlab`` command."""

import sys

from llmlab.cli import main

if __name__ == "__main__":
    sys.exit(main())
