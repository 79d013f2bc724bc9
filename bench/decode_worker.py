"""One decoder in a process of its own, driven by a benchmark through stdin and stdout (one JSON
object a line): the process's peak memory is that decoder's alone, and while one contender
decodes, the others wait on a read, so interleaved rounds do not share the cores.

    python bench/decode_worker.py slimlm ARTIFACT --threads 2 --slots 656
    python bench/decode_worker.py llama.cpp FILE.gguf --threads 2 --slots 656

The worker loads its model, says {"ready": ...}, then answers each request with one line:
  {"compile": true}                          -> {"compile_s"}  (slimlm: compile the decode step)
  {"prompt": [ids], "new_tokens": N,
   "compiled": bool}                         -> {"decode_tok_s", "ttft_s"}  (greedy, no end token)
  {"memory": true}                           -> {"peak_rss_bytes", "rss_bytes"}
Malformed requests end the worker with a message on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

Answer = dict[str, float]


def memory() -> Answer:
    """This process's peak and current resident memory (Linux /proc)."""
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    kib = lambda key: int(fields[key].split()[0]) * 1024  # noqa: E731
    return {"peak_rss_bytes": kib("VmHWM"), "rss_bytes": kib("VmRSS")}


class SlimlmDecoding:
    """An artifact loaded as `slimlm generate` loads it (one layer at a time, int8 activations),
    its cache sized once for `slots`; eager and compiled steps share the weights and the cache."""

    def __init__(self, path: Path, threads: int, slots: int):
        from transformers import AutoTokenizer

        from slimlm.inference.decoder import Decoder
        from slimlm.inference.load import load_decoder

        torch.set_num_threads(threads)
        model, _ = load_decoder(path, dtype=torch.bfloat16, int8_activations=True)
        self.decoder = Decoder(model, AutoTokenizer.from_pretrained(path), reuse_prefixes=False)
        model.setup_cache(1, slots)  # once: the compiled step is specialized to the cache's size
        self.eager: Callable = self.decoder.step
        self.compiled: Callable = self.eager

    def close(self) -> None:
        pass

    def compile(self) -> Answer:
        """Compile the decode step for the cache (`slimlm generate --compile`'s warm-up)."""
        self.decoder.compile_decode_step()
        self.compiled = self.decoder.step
        return {"compile_s": self.decoder.warm_up_step()}

    @torch.inference_mode()
    def decode(self, prompt: list[int], new_tokens: int, compiled: bool) -> Answer:
        from slimlm.inference.sampling import SamplingParams

        self.decoder.step = self.compiled if compiled else self.eager
        self.decoder.generate_ids([prompt], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        stats = self.decoder.last_stats
        return {
            "decode_tok_s": stats.decode_tok_s,
            "ttft_s": stats.prefill_s,
            "bytes_per_token": self.decoder.model.bytes_per_token(len(prompt) + new_tokens // 2),
            "weight_bytes": self.decoder.model.weight_bytes(),
        }


class LlamaCppDecoding:
    """A GGUF file in llama-cpp-python, greedy through its own loop (eval one token, take the
    argmax); prompts evaluated 512 tokens a batch, logits kept for the last position only."""

    def __init__(self, path: Path, threads: int, slots: int):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(path),
            n_ctx=slots,
            n_batch=512,
            n_ubatch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def compile(self) -> Answer:
        return {"compile_s": 0.0}

    def close(self) -> None:
        self.llm.close()  # now, not in the interpreter's teardown (where llama-cpp-python's fails)

    def next_token(self) -> int:
        """The argmax of the last evaluated position's logits, read from llama.cpp's own buffer
        (without logits_all the Python wrapper keeps no copy of them)."""
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))

    def decode(self, prompt: list[int], new_tokens: int, compiled: bool) -> Answer:
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(prompt)
        token = self.next_token()
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval([token])
            token = self.next_token()
        return {"decode_tok_s": (new_tokens - 1) / (time.perf_counter() - first), "ttft_s": first - started}


def answer(decoding, request: dict) -> Answer:
    if request.get("compile"):
        return decoding.compile()
    if request.get("memory"):
        return memory()
    prompt, new_tokens = request["prompt"], int(request["new_tokens"])
    if not prompt or not all(isinstance(token, int) for token in prompt) or new_tokens < 2:
        raise ValueError("a decode request needs a non-empty list of token ids and new_tokens >= 2")
    return decoding.decode(prompt, new_tokens, bool(request.get("compiled")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tool", choices=("slimlm", "llama.cpp"))
    parser.add_argument("path", type=Path, help="a slimlm artifact directory or a GGUF file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, required=True, help="the longest prompt plus new tokens")
    options = parser.parse_args()
    kind = SlimlmDecoding if options.tool == "slimlm" else LlamaCppDecoding
    started = time.perf_counter()
    decoding = kind(options.path, options.threads, options.slots)
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - started, **memory()}), flush=True)
    for line in sys.stdin:
        try:
            reply = answer(decoding, json.loads(line))
        except (ValueError, KeyError, TypeError) as error:
            raise SystemExit(f"decode_worker: bad request {line.strip()[:200]!r}: {error}") from None
        print(json.dumps(reply), flush=True)
    decoding.close()


if __name__ == "__main__":
    main()
