"""The generation engine (infer/engine/): continuous batching gives each sequence the tokens it gets alone (fp32
greedy: equal to a full recompute; seeded sampling: equal for the same seed), whatever the slots, the prefill
chunk or the company; a finished or cancelled sequence frees its slot at once; n samples read their prompt once;
a long prompt is read in chunks while others decode; `extend` goes on from the cache; log-probs equal a fresh
forward's."""
import random

import pytest
import torch

from nanoforge.core.config import ModelConfig
from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.options import SamplingConfig
from nanoforge.infer.engine import Engine, Request
from nanoforge.model.gpt import GPT

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models decode on one thread

GREEDY = SamplingConfig(temperature=0, max_new_tokens=24)


def model(seed: int = 0, **overrides) -> GPT:
    """Random weights that give varied greedy text (untied, wider init: see test_generate.random_model)."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256,
                 tie_embeddings=False, init_std=0.1)
    return GPT(ModelConfig(**{**shape, **overrides})).eval()


def prompts(n: int, seed: int = 1, longest: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def recompute(m: GPT, prompt: list[int], n: int) -> list[int]:
    """Greedy by recomputing the whole sequence every step: no cache at all."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


class Counter:
    """Counts the tokens the model is fed, per forward."""

    def __init__(self, m: GPT):
        self.fed: list[int] = []
        m.register_forward_hook(lambda module, args, kwargs, out: self.fed.append(args[0].shape[1]),
                                with_kwargs=True)


@pytest.mark.parametrize("max_batch,chunk", [(1, 1), (2, 3), (3, 7), (8, 512)])
def test_any_batching_gives_the_full_recompute(max_batch, chunk):
    m = model()
    ps = prompts(8)
    groups = Engine(m, max_batch=max_batch, prefill_chunk=chunk).run([Request(p, GREEDY) for p in ps])
    assert [g[0].new_ids for g in groups] == [recompute(m, p, GREEDY.max_new_tokens) for p in ps]
    assert all(g[0].finish_reason == "length" and g[0].slot is None for g in groups)


def test_qk_norm_moe_and_yarn_shapes_decode_like_a_recompute():
    for overrides in (dict(qk_norm=True), dict(n_experts=4, experts_per_token=2), dict(rope_scaling_factor=2.0)):
        m = model(**overrides)
        ps = prompts(4, seed=3)
        groups = Engine(m, max_batch=2, prefill_chunk=5).run([Request(p, GREEDY) for p in ps])
        assert [g[0].new_ids for g in groups] == [recompute(m, p, GREEDY.max_new_tokens) for p in ps], overrides


def test_a_seeded_sample_is_the_same_in_any_company():
    m = model()
    ps = prompts(6, seed=2)
    cfgs = [SamplingConfig(temperature=t, top_k=k, top_p=p, repetition_penalty=r, max_new_tokens=30, seed=s)
            for t, k, p, r, s in [(1.0, 0, 1.0, 1.0, 1), (0.7, 20, 0.9, 1.1, 2), (1.3, 5, 1.0, 1.0, 3),
                                  (0.9, 0, 0.5, 1.0, 4), (0, 0, 1.0, 1.3, None), (1.0, 50, 0.95, 1.0, 5)]]
    together = Engine(m, max_batch=6, prefill_chunk=16).run([Request(p, c) for p, c in zip(ps, cfgs)])
    for p, c, g in zip(ps, cfgs, together):
        alone = Engine(m, max_batch=1).run([Request(p, c)])[0][0]
        assert alone.new_ids == g[0].new_ids
    assert len({tuple(g[0].new_ids) for g in together}) == 6


def test_n_samples_read_the_prompt_once_and_differ():
    m = model()
    counter = Counter(m)
    prompt = prompts(1, seed=4, longest=1)[0] * 50  # 50 tokens
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10, seed=7)
    (samples,) = Engine(m, max_batch=4).run([Request(prompt, cfg, n=4)])
    assert sum(counter.fed) == 50 + 4 * 9  # the prompt once, then each sample's 9 fed tokens (the 10th is not)
    assert len({tuple(s.new_ids) for s in samples}) == 4
    alone = Engine(m, max_batch=1).run([Request(prompt, cfg, seeds=[samples[2].sampling.generator.initial_seed()])])
    assert alone[0][0].new_ids == samples[2].new_ids


def test_a_finished_sequence_frees_its_slot_for_a_waiting_one():
    m = model()
    short = Request(prompts(1, seed=5)[0], SamplingConfig(temperature=0, max_new_tokens=2))
    long = Request(prompts(1, seed=6)[0], SamplingConfig(temperature=0, max_new_tokens=40))
    waiting = Request(prompts(1, seed=7)[0], SamplingConfig(temperature=0, max_new_tokens=3))
    engine = Engine(m, max_batch=2)
    seqs = [engine.submit(r)[0] for r in (short, long, waiting)]
    finished_at = {}
    while engine.busy:
        for seq in engine.step():
            if seq.done:
                finished_at[seqs.index(seq)] = engine.steps
    assert finished_at[2] < finished_at[1], "the third sequence waited for the long one"
    assert len(engine.slots) == 0 and engine.cache.slots <= 4


def test_a_long_prompt_is_read_in_chunks_while_another_decodes():
    m = model(max_seq_len=512)
    engine = Engine(m, max_batch=2, prefill_chunk=32)
    decoding = engine.submit(Request(prompts(1, seed=8)[0], SamplingConfig(temperature=0, max_new_tokens=60)))[0]
    engine.step()  # its prompt read, its first token sampled
    long = engine.submit(Request(prompts(1, seed=9, longest=1)[0] * 300, GREEDY))[0]
    before = len(decoding.new_ids)
    while not long.new_ids:
        engine.step()
    assert len(decoding.new_ids) - before >= 300 // 32, "the decoding sequence stalled behind the long prompt"
    while engine.busy:
        engine.step()
    assert long.new_ids == recompute(m, long.tokens[:300], GREEDY.max_new_tokens)


def test_cancel_frees_the_slot_and_spares_the_others():
    m = model()
    ps = prompts(3, seed=10)
    engine = Engine(m, max_batch=3)
    seqs = [engine.submit(Request(p, GREEDY))[0] for p in ps]
    for _ in range(5):
        engine.step()
    engine.cancel(seqs[0])
    assert seqs[0].finish_reason == "cancelled" and seqs[0].slot is None and len(engine.slots) == 2
    while engine.busy:
        engine.step()
    assert [s.new_ids for s in seqs[1:]] == [recompute(m, p, GREEDY.max_new_tokens) for p in ps[1:]]


def test_cancelling_the_sample_that_reads_a_shared_prompt_hands_it_on():
    m = model()
    prompt = prompts(1, seed=11)[0]
    engine = Engine(m, max_batch=3, prefill_chunk=4)
    first, *rest = engine.submit(Request(prompt, SamplingConfig(temperature=1.0, max_new_tokens=8, seed=1), n=3))
    engine.step()
    engine.cancel(first)
    while engine.busy:
        engine.step()
    assert all(len(s.new_ids) == 8 and s.finish_reason == "length" for s in rest)


def test_extend_goes_on_from_the_cache_like_a_longer_prompt():
    m = model()
    counter = Counter(m)
    prompt, more = prompts(2, seed=12, longest=20)
    stop = SamplingConfig(temperature=0, max_new_tokens=6)
    engine = Engine(m, max_batch=1)
    (seq,) = engine.submit(Request(prompt, stop, keep_slot=True))
    while engine.busy:
        engine.step()
    first = list(seq.new_ids)
    fed = sum(counter.fed)
    engine.extend(seq, more)
    while engine.busy:
        engine.step()
    assert sum(counter.fed) - fed == 1 + len(more) + 5, "only the new tokens are read"
    assert first == recompute(m, prompt, 6)
    assert seq.new_ids == recompute(m, prompt + first + more, 6)
    assert seq.sampled == [False] * len(prompt) + [True] * 6 + [False] * len(more) + [True] * 6
    engine.release(seq)
    assert seq.slot is None


def test_logprobs_are_a_fresh_forwards_at_the_temperature():
    m = model()
    prompt = prompts(1, seed=13)[0]
    cfg = SamplingConfig(temperature=0.8, top_k=40, max_new_tokens=12, seed=3)
    (seq,) = Engine(m, max_batch=1).run([Request(prompt, cfg, top_logprobs=3)])[0]
    with torch.no_grad():
        logits = m(torch.tensor([prompt + seq.new_ids]))[0].float()
    fresh = torch.log_softmax(logits / 0.8, dim=-1)[len(prompt) - 1:]
    assert seq.logprobs == pytest.approx([fresh[i, t].item() for i, t in enumerate(seq.new_ids)], abs=1e-5)
    top = fresh[0].topk(3)
    assert [t for t, _ in seq.top_logprobs[0]] == top.indices.tolist()


@pytest.mark.parametrize("chunk", [3, 512])
def test_prompt_logprobs_are_a_fresh_forwards_in_any_chunks(chunk):
    m = model()
    prompt, other = prompts(2, seed=15, longest=40)
    engine = Engine(m, max_batch=3, prefill_chunk=chunk)
    scored = Request(prompt, SamplingConfig(temperature=0, max_new_tokens=3), n=2, prompt_logprobs=True,
                     top_logprobs=2)
    groups = engine.run([Request(other, GREEDY), scored])
    with torch.no_grad():
        fresh = torch.log_softmax(m(torch.tensor([prompt]))[0].float(), dim=-1)  # (T, V)
    for seq in groups[1]:
        assert [lp for lp, _ in seq.prompt_logprobs] == \
            pytest.approx([fresh[i, t].item() for i, t in enumerate(prompt[1:])], abs=1e-5)
        assert [[t for t, _ in top] for _, top in seq.prompt_logprobs] == fresh[:-1].topk(2).indices.tolist()
        assert seq.new_ids == recompute(m, prompt, 3)
    assert groups[0][0].prompt_logprobs == [] and groups[0][0].new_ids == recompute(m, other, GREEDY.max_new_tokens)


def test_stop_ids_and_the_context_end_a_sequence():
    m = model(max_seq_len=32)
    prompt = prompts(1, seed=14, longest=20)[0]
    free = Engine(m, max_batch=1).run([Request(prompt, SamplingConfig(temperature=0, max_new_tokens=200))])[0][0]
    assert free.finish_reason == "length" and len(prompt) + len(free.new_ids) == 32
    stop = free.new_ids[3]
    stopped = Engine(m, max_batch=1).run([Request(prompt, GREEDY, stop_ids=(stop,))])[0][0]
    first = free.new_ids.index(stop)
    assert stopped.new_ids == free.new_ids[:first] and stopped.stop_id == stop and stopped.finish_reason == "stop"


def test_bad_requests_are_refused():
    engine = Engine(model(max_seq_len=32), max_batch=2)
    for request, message in [(Request([], GREEDY), "empty"), (Request([1, 512], GREEDY), "vocabulary"),
                             (Request([1] * 32, GREEDY), "no room"), (Request([1], GREEDY, n=3), "n=3"),
                             (Request([1], GREEDY, n=2, seeds=[1]), "seeds")]:
        with pytest.raises(NanoforgeError, match=message):
            engine.submit(request)
    with pytest.raises(NanoforgeError, match="stop_strings need the tokenizer"):
        engine.submit(Request([1], SamplingConfig(stop_strings=["x"])))
    with pytest.raises(NanoforgeError, match="max_batch"):
        Engine(model(), max_batch=0)
