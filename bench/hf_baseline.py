"""Hugging Face transformers' batched ``generate`` as the batching lab's peer baseline."""

from __future__ import annotations

import time

from .report import RequestTiming, policy_entry
from .workloads import BenchRequest


def run_hf(model: str, requests: list[BenchRequest], batch_size: int, threads: int) -> dict:
    """Hugging Face ``generate`` as static batching: batches of ``batch_size`` in arrival
    order, left-padded, greedy, every member run to the batch's longest output
    (``min_new_tokens`` keeps EOS from ending it early); a member's useful output is
    its first ``output_len`` tokens.

    A batch starts when the previous one has returned and its last member has
    arrived; the clock between batches is virtual (no sleeping). Tokens are timed
    per generated position, as if streamed: TTFT is the first position's time and
    E2E the time of a member's last useful token, generous to the baseline, since
    ``generate`` itself returns the whole batch at the end.
    """
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        """Records when each generated position is ready; never stops generation."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    timings, free_at, useful, slots_x_positions, padding, computed = [], 0.0, 0, 0, 0, 0
    generate_s = 0.0
    try:
        for b in range(0, len(requests), batch_size):
            batch = requests[b : b + batch_size]
            width = max(len(r.prompt_ids) for r in batch)
            new = max(r.output_len for r in batch)
            ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
            mask = (
                torch.arange(width) >= width - torch.tensor([[len(r.prompt_ids)] for r in batch])
            ).long()
            clock = Clock()
            start = time.perf_counter()
            with torch.no_grad():
                hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=pad,
                            stopping_criteria=StoppingCriteriaList([clock]))  # fmt: skip
            began = max(free_at, batch[-1].arrival_s)
            positions = [began + t - start for t in clock.times]  # [new]
            free_at = positions[-1]
            generate_s += clock.times[-1] - start
            for r in batch:
                timing = RequestTiming(sent_s=r.arrival_s)
                for t in positions[: r.output_len]:
                    timing.add(t, 1)
                timings.append(timing)
            useful += sum(r.output_len for r in batch)
            slots_x_positions += batch_size * new
            padding += sum(width - len(r.prompt_ids) + new - r.output_len for r in batch)
            computed += len(batch) * (width + new)
    finally:
        torch.set_num_threads(saved)
    steps = {
        "slot_utilization": round(useful / slots_x_positions, 4),
        "padding_fraction": round(padding / computed, 4),
        "num_steps": (len(requests) + batch_size - 1) // batch_size,  # generate calls
        "step_ms_mean": round(1000 * generate_s / (slots_x_positions / batch_size), 2),
        "num_padding_tokens": padding,
    }
    return policy_entry([r.kind for r in requests], timings, free_at, steps)
