"""An optional answer backend for the simulator: a real local causal LM decoding greedily.

`regen sim --hf-model PATH --tokenizer PATH` keeps every HTTP shape, fault switch and the capacity
model of the simulator, but the answer's ids are the model's own greedy continuation of the prompt
(stopping at its eos or at max_new_tokens) instead of deterministic filler. Meant for CPU dry runs with
a tiny model, and for checking end to end that a draft trained on regen's output learns the target:
the data then really is the target's. Slow (it runs the model in the request path); torch is
imported only when this backend is used.
"""

from __future__ import annotations

import threading

from regen_service.sim.answers import Answer


class HFAnswerer:
    def __init__(self, model_path: str, max_new_tokens_cap: int):
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True).eval()
        self.eos_id = self.model.config.eos_token_id
        self.cap = max_new_tokens_cap
        self._lock = threading.Lock()  # one generation at a time: torch on CPU is already parallel inside

    def answer(self, prompt_ids: list[int], max_new_tokens: int) -> Answer:
        torch = self._torch
        n = max(1, min(max_new_tokens, self.cap))
        x = torch.tensor([prompt_ids])
        with self._lock, torch.no_grad():
            out = self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=self.eos_id,
            )
        ids = out[0, len(prompt_ids) :].tolist()
        eos = self.eos_id if isinstance(self.eos_id, list) else [self.eos_id]
        for i, t in enumerate(ids):
            if t in eos:  # the stop token is not part of output_ids, as with the filler backend
                ids = ids[:i]
                break
        return Answer(ids=ids, reasoning=None, content=(0, len(ids)), tool=None, tool_call=None)
