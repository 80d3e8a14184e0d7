"""Decoding speed with the engine's KV cache against recomputing the whole sequence every step.

    .venv/bin/python benchmarks/decode_speed.py [--preset mini] [--new-tokens 256] [--prompt-len 16] [--repeats 3]

Batch 1, greedy, fp32, random weights (speed does not depend on what the weights say). No stop ids are
given, so every run generates exactly --new-tokens tokens. Each configuration is timed --repeats times after
one short warm-up and the median is reported, as tokens/s of generated text.

Without the cache, step t runs the model over all prompt_len + t tokens, so a reply of n tokens costs
O(n^2) token-forwards against O(n) with the cache: the ratio grows with the reply's length.
"""
import argparse
import statistics
import time

import torch

from nanoforge.infer.generate import SamplingConfig, generate


def recompute(model, prompt: list[int], cfg: SamplingConfig, stop_ids=None) -> list[list[int]]:
    """Greedy without a cache: every step runs the model over the whole sequence."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(cfg.max_new_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return [ids[len(prompt):]]


def time_decode(model, prompt: list[int], new_tokens: int, use_cache: bool, repeats: int) -> list[float]:
    """Seconds for each of `repeats` runs generating exactly `new_tokens` tokens."""
    decode = (lambda m, p, c: generate(m, p, c)) if use_cache else (lambda m, p, c: recompute(m, p[0], c))
    decode(model, [prompt], SamplingConfig(temperature=0, max_new_tokens=8))  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = decode(model, [prompt], SamplingConfig(temperature=0, max_new_tokens=new_tokens))
        seconds.append(time.perf_counter() - start)
        assert len(out[0]) == new_tokens, "the benchmark must generate every token it times"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mini", help="model shape preset (default: mini, ~26M parameters)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()

    from nanoforge.core.config import build_config
    from nanoforge.model.gpt import GPT

    if args.threads:
        torch.set_num_threads(args.threads)
    mcfg, _ = build_config(args.preset)
    if args.prompt_len + args.new_tokens > mcfg.max_seq_len:
        parser.error(f"--prompt-len + --new-tokens must fit the model's {mcfg.max_seq_len} positions")
    torch.manual_seed(0)
    model = GPT(mcfg).eval()
    prompt = torch.randint(0, mcfg.vocab_size, (args.prompt_len,)).tolist()

    print(f"preset {args.preset}: {model.num_params() / 1e6:.1f}M parameters, fp32, CPU, "
          f"{torch.get_num_threads()} threads; batch 1, prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")
    rates = {}
    for name, use_cache in (("kv cache", True), ("full recompute", False)):
        seconds = time_decode(model, prompt, args.new_tokens, use_cache, args.repeats)
        rates[name] = args.new_tokens / statistics.median(seconds)
        runs = ", ".join(f"{s:.2f}" for s in seconds)
        print(f"  {name:15s} {rates[name]:8.1f} tokens/s   (runs: {runs} s)")
    print(f"  speed-up with the cache: {rates['kv cache'] / rates['full recompute']:.1f}x")


if __name__ == "__main__":
    main()
