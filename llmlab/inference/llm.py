"""``LLM``: vLLM's offline API over :class:`~llmlab.inference.engine.LLMEngine`.

from llmlab.inference import LLM, SamplingParams
llm = LLM("shakespeare")                      # the model shipped with llmlab
out = llm.generate(["ROMEO:"], SamplingParams(temperature=0.8, seed=0, max_tokens=64))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from typing import Any, cast

from llmlab.inference.engine import LLMEngine, Prompt
from llmlab.inference.engine_config import EngineConfig
from llmlab.inference.loader import ModelSpec
from llmlab.inference.outputs import RequestOutput, error_output
from llmlab.inference.sampling import SamplingParams

# One SamplingParams for every prompt, one per prompt, or None (the defaults).
ParamsArg = SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...] | None


def _as_batch(prompts: Prompt | Iterable[Prompt]) -> list[Prompt]:
    """One prompt (text, a request dict or a list of token ids) as a batch of one, else the list
    of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [cast(list[int], prompts)]  # token ids: one prompt
    return list(cast(Iterable[Prompt], prompts))  # (not a str, dict or id list: checked above)


class LLM:
    """Offline generation, vLLM style: ``LLM(model, **engine_args).generate(prompts, params)``.

    ``model``: a preset with shipped weights (default ``"shakespeare"``), a checkpoint directory,
    an ``LlamaForCausalLM`` or a ``ModelConfig``; ``config`` (an
    :class:`~llmlab.inference.engine_config.EngineConfig`) and/or ``engine_args`` (its fields) as
    :class:`LLMEngine`. A request the engine refuses, or whose forward pass or sampling fails,
    gets an error output; the others complete.
    """

    def __init__(
        self,
        model: ModelSpec = "shakespeare",
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        **engine_args: Any,
    ) -> None:
        self.engine = LLMEngine(model, tokenizer, config, **engine_args)
        self._error_ids = itertools.count()

    def start_profile(self) -> None:
        """Record a PyTorch profiler trace of what follows (needs ``profile_dir``; vLLM's)."""
        self.engine.start_profile()

    def stop_profile(self) -> str:
        """Stop recording; returns the trace's path."""
        return self.engine.stop_profile()

    def _add(
        self, prompts: Prompt | Iterable[Prompt], sampling_params: ParamsArg
    ) -> list[str | RequestOutput]:
        """Queue every prompt; a request the engine refuses (``ValueError``: empty prompt, too
        long, bad ids or parameters) becomes a finished error output in its place, so one bad
        request never fails the batch. Returns request ids and error outputs, in order."""
        prompts = _as_batch(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        entries: list[str | RequestOutput] = []
        for p, sp in zip(prompts, params):
            try:
                entries.append(self.engine.add_request(p, sp))
            except ValueError as e:
                rid = f"error-{next(self._error_ids)}"
                entries.append(error_output(rid, p, str(e), time.perf_counter()))
        return entries

    def _release(self, entries: list[str | RequestOutput]) -> None:
        for rid in entries:
            if isinstance(rid, str):
                self.engine.abort_request(rid)  # no-op when finished; frees on early exit
                self.engine.release(rid)

    def stream(
        self, prompts: Prompt | Iterable[Prompt], sampling_params: ParamsArg = None
    ) -> Iterator[RequestOutput]:
        """Yield a :class:`RequestOutput` every time a request gets new tokens (streaming); a
        refused request is yielded once, first, with ``finish_reason="error"``."""
        entries = self._add(prompts, sampling_params)
        try:
            yield from (e for e in entries if not isinstance(e, str))
            while self.engine.has_unfinished_requests():
                yield from self.engine.step()
        finally:
            self._release(entries)

    def generate(
        self, prompts: Prompt | Iterable[Prompt], sampling_params: ParamsArg = None, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts`` (text, token-id lists or request dicts), one for
        every prompt: a refused or failed request has ``finish_reason="error"`` and ``error``.
        A vision-language model's request dict may carry ``"multi_modal_data": {"image": [...]}``
        (PIL images, paths or bytes; one ``<|image_pad|>`` placeholder per image in the prompt)
        and ``"mm_processor_kwargs": {"max_pixels": ..., "min_pixels": ...}``
        (:mod:`llmlab.inference.multimodal`)."""
        entries = self._add(prompts, sampling_params)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(entries), desc="generate")
        try:
            while self.engine.has_unfinished_requests():
                for o in self.engine.step():
                    if bar is not None and o.finished:
                        bar.update(1)
            return [self.engine.get_output(e) if isinstance(e, str) else e for e in entries]
        finally:
            if bar is not None:
                bar.close()
            self._release(entries)
