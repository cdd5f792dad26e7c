"""Measuring tools that sit on top of the library: ``llmlab bench comm``
(:mod:`llmlab.tools.comm_bench`) and the expert-parallel probe of lab 04
(:mod:`llmlab.tools.ep_probe`). They may import any layer below them (runtime, model, parallel,
training); nothing in the library imports them."""
