"""The classroom: one JupyterHub node shared by a room of learners (``classroom/jupyterhub_config.py``,
docs/workshop.md). :mod:`~llmlab.classroom.seats` shares the node's GPUs and cores out,
:mod:`~llmlab.classroom.singleuser` starts a learner's server on their seat, and
:mod:`~llmlab.classroom.results` gathers the room's exercise results (``llmlab classroom results``)."""
