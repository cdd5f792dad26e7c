"""Shared test settings: ranks are real processes (gloo on CPU); keep every test small."""
import os

os.environ.setdefault("LLMLAB_LIVE", "0")
os.environ.setdefault("LLMLAB_PG_TIMEOUT", "120")
