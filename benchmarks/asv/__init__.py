"""llmlab's asv suite (asv.conf.json; docs/profiling.md). Run through benchmarks/asv_compare.py,
which sets ``LLMLAB_ASV_TREE`` to the commit's checkout: llmlab must be imported from there."""
import os

import llmlab

_tree = os.environ.get("LLMLAB_ASV_TREE")
if _tree and not os.path.realpath(llmlab.__file__).startswith(os.path.realpath(_tree)):
    raise ImportError(f"the asv suite imported llmlab from {llmlab.__file__}, not from the commit "
                      f"under test in {_tree}")
