"""Closed-form costs of training at scale: one module per family, one definition per formula.

* :mod:`llmlab.formulas.memory`: bytes of model states (parameters, gradients, optimizer states),
  unsharded and under ZeRO stages 0-3 (Rajbhandari et al. 2020, §3.1, §5).
* :mod:`llmlab.formulas.compute`: training FLOPs 6·N·T (Kaplan et al. 2020) and per-block FLOPs.
* :mod:`llmlab.formulas.communication`: the α-β cost of a ring all-reduce, bytes per step of
  DDP/ZeRO (ZeRO §7) and of tensor (+ sequence) parallelism (Megatron-LM; Korthikanti et al. 2022).
* :mod:`llmlab.formulas.pipeline`: the pipeline bubble and the micro-batches a stage holds
  (GPipe; Megatron-LM SC'21 §2.2; Korthikanti et al. 2022 §4.2.3).
* :mod:`llmlab.formulas.activations`: bytes a transformer layer saves for backward (Korthikanti
  et al. 2022, eqs. 1-3) and the count for llmlab's own Llama block.

Plain Python on numbers (no torch): the package's bottom layer. ``llmlab.estimate`` (the
``llmlab estimate`` command), ``llmlab.planner`` (``llmlab plan``), ``llmlab.parallel``, the labs, the exercise checks and the tests
all import these functions instead of writing a formula again. Serving metrics (TTFT, TPOT) are
defined beside the engine that measures them, in :mod:`llmlab.inference.metrics`.
"""
