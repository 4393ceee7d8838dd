"""`python -m pagedllm.demo` (what `bash scripts/demo.sh` runs): chat with the bundled
SmolLM2-135M-Instruct through the offline API and print the replies and the generation speed.

Options: --max-tokens N (default 96), --dtype (default auto = float32 for the bundled model: its
bfloat16 greedy replies are visibly worse, in Hugging Face transformers too), --threads N (torch
and kernel threads; default: all cores).
"""

from __future__ import annotations

import argparse
import logging
import time

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences what a hash table is.",
    "Give me three tips for learning a new language.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    import torch

    from pagedllm import LLM, SamplingParams, _C, ops

    if args.threads > 0:
        torch.set_num_threads(args.threads)
        ops.set_num_threads(args.threads)
    print(f"pagedllm._C loaded; built with CUDA: {_C.built_with_cuda}; CUDA devices: {_C.cuda_device_count()}")
    start = time.perf_counter()
    llm = LLM(dtype=args.dtype)
    print(f"engine ready in {time.perf_counter() - start:.1f} s")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = 0
    for prompt, out in zip(PROMPTS, outputs):
        comp = out.outputs[0]
        generated += len(comp.token_ids)
        print(f"\n### {prompt}\n{comp.text.strip()}\n[{len(comp.token_ids)} tokens, finish_reason={comp.finish_reason}]")
    print(f"\n{len(PROMPTS)} prompts, {generated} tokens generated in {seconds:.2f} s: {generated / seconds:.1f} tok/s")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
