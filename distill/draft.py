"""How good a student is as a speculative-decoding draft for its teacher.

Greedy speculative decoding in the bundled decoder (inference/speculative.py): the draft guesses
`lookahead` tokens, the teacher checks them in one pass and keeps the longest agreeing prefix,
so the output is the teacher's own greedy output. Reported: the acceptance rate of the guesses,
new tokens per teacher pass, the speed-up over plain greedy decoding of the teacher, and
whether every output was identical to plain decoding (it must be).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.inference.sampling import SamplingParams
from slimlm.inference.speculative import generate_speculative


@torch.inference_mode()
def draft_report(
    teacher: nn.Module,
    student: nn.Module,
    tokenizer,
    prompts: list[list[int]],
    new_tokens: int = 48,
    lookahead: int = 4,
) -> dict:
    target = Decoder(
        build_decoder(teacher, dtype=torch.float32), tokenizer, reuse_prefixes=False
    )  # both ways prefill each prompt whole
    draft = Decoder(build_decoder(student, dtype=torch.float32), tokenizer, reuse_prefixes=False)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    target.generate_ids([prompts[0]], params)  # warm-up: both caches allocated once
    generate_speculative(target, prompts[0], params, draft=draft, lookahead=lookahead)
    proposed = accepted = passes = produced = 0
    plain_s = speculative_s = 0.0
    identical = True
    for prompt in prompts:
        start = time.perf_counter()
        (plain,) = target.generate_ids([prompt], params)
        plain_s += time.perf_counter() - start
        start = time.perf_counter()
        fast, stats = generate_speculative(target, prompt, params, draft=draft, lookahead=lookahead)
        speculative_s += time.perf_counter() - start
        identical &= fast.token_ids == plain.token_ids
        proposed, accepted, passes, produced = (
            proposed + stats.proposed,
            accepted + stats.accepted,
            passes + stats.target_passes,
            produced + stats.new_tokens,
        )
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "lookahead": lookahead,
        "acceptance_rate": accepted / max(proposed, 1),
        "tokens_per_teacher_pass": produced / max(passes, 1),
        "plain_tok_s": produced / plain_s,
        "speculative_tok_s": produced / speculative_s,
        "speedup": plain_s / speculative_s,
        "identical_to_plain": identical,
    }
