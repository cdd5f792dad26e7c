"""``LLM``: vLLM's offline API over :class:`~llmlab.inference.engine.LLMEngine`.

    from llmlab.inference import LLM, SamplingParams
    llm = LLM("shakespeare")                      # the model shipped with llmlab
    out = llm.generate(["ROMEO:"], SamplingParams(temperature=0.8, seed=0, max_tokens=64))
    print(out[0].outputs[0].text)
"""
from __future__ import annotations

from llmlab.inference.engine import LLMEngine
from llmlab.inference.outputs import RequestOutput
from llmlab.inference.sampling import SamplingParams


class LLM:
    """Offline generation, vLLM style: ``LLM(model, **engine_args).generate(prompts, params)``.

    ``model``: a preset with shipped weights (default ``"shakespeare"``), a checkpoint directory,
    an ``LlamaForCausalLM`` or a ``ModelConfig``; ``engine_args`` as :class:`LLMEngine`.
    """

    def __init__(self, model="shakespeare", tokenizer=None, **engine_args):
        self.engine = LLMEngine(model, tokenizer, **engine_args)

    def _add(self, prompts, sampling_params) -> list[str]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp))
        except Exception:
            for rid in ids:                         # refuse the whole batch, leak nothing
                self.engine.abort_request(rid)
                self.engine.release(rid)
            raise
        return ids

    def stream(self, prompts, sampling_params=None):
        """Yield a :class:`RequestOutput` every time a request gets new tokens (streaming)."""
        ids = self._add(prompts, sampling_params)
        try:
            while self.engine.has_unfinished_requests():
                yield from self.engine.step()
        finally:
            for rid in ids:
                self.engine.abort_request(rid)     # no-op when finished; frees on early exit
                self.engine.release(rid)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in the order of ``prompts`` (text, token-id lists or request dicts)."""
        ids = self._add(prompts, sampling_params)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="generate")
        try:
            while self.engine.has_unfinished_requests():
                for o in self.engine.step():
                    if bar is not None and o.finished:
                        bar.update(1)
            return [self.engine.get_output(rid) for rid in ids]
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:
                self.engine.abort_request(rid)
                self.engine.release(rid)
