"""Generation: the KV cache against a full recompute, batches against single prompts, stopping, sampling
filters, seeds, and streaming text that never shows half a character or part of a stop string."""
from __future__ import annotations

import pytest
import torch

from nanoforge.core.config import ModelConfig
from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.engine.sampler import RowSampling, apply_repetition_penalty, sample_rows
from nanoforge.infer.generate import SamplingConfig, complete, cut_at_stop, generate, stream
from nanoforge.model.gpt import GPT

GREEDY = SamplingConfig(temperature=0, max_new_tokens=40)
CHINESE = "春天来了，小河里的冰化了。"
# Rare characters that the tiny tokenizer (trained on ../shared's tiny files or on the fallback corpus, which
# has CHINESE itself, whole) never merged: their byte-level tokens split each character across steps.
SPLIT_CHINESE = "鲸鱼在蔚蓝的海里唱歌，鹦鹉学舌。"

_RUNS: dict[str, object] = {}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models decode on one thread


def make_tiny_run(tmp_path_factory, tokenizer):
    """A real run directory: the tiny preset pretrained for 30 steps. Built once per test session (the chat
    tests import this too)."""
    if "run" not in _RUNS:
        from conftest import tiny_corpus
        from nanoforge.data.prepare import prepare_dataset
        from nanoforge.recipes.pretrain import pretrain

        work = tmp_path_factory.mktemp("tiny_run")
        files = tiny_corpus(work)[:1]
        prepare_dataset("pretrain", files, tokenizer, work / "data", val_fraction=0.1, workers=1,
                        log=lambda *a: None)
        pretrain([str(work / "data")], work / "run", preset="tiny", quiet=True,
                 overrides={"max_steps": 30, "tensorboard": False, "eval_every": 0, "seq_len": 32,
                            "precision": "fp32"})
        _RUNS["run"] = work / "run"
    return _RUNS["run"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_tokenizer):
    from nanoforge.weights.load import load_model

    model, tokenizer, _ = load_model(make_tiny_run(tmp_path_factory, tiny_tokenizer))
    return model, tokenizer


def random_model(seed: int = 0, **overrides) -> GPT:
    """Random weights that still give varied greedy text: untied and with a wider init, because a tied random
    model mostly predicts its own input token back (the embedding dominates the residual stream)."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128,
                 tie_embeddings=False, init_std=0.1)
    return GPT(ModelConfig(**{**shape, **overrides})).eval()


class ScriptedGPT(GPT):
    """A real GPT whose logits are pushed, step by step after the prompt, towards the tokens of `script`:
    a way to make the model "say" chosen text (a stop string, Chinese split across byte-level tokens, eos)
    through the real decoding path (the engine's slot steps): the step is read off each row's position."""

    def __init__(self, cfg: ModelConfig, script: list[int], prompt_len: int):
        super().__init__(cfg)
        self.script, self.prompt_len = script, prompt_len

    def forward(self, input_ids, cache=None, keep=None):
        positions = cache.positions[keep].tolist()  # the position each row of logits continues from
        logits = super().forward(input_ids, cache=cache, keep=keep)
        for row, position in enumerate(positions):
            step = position + 1 - self.prompt_len
            if 0 <= step < len(self.script):
                logits[row, self.script[step]] += 1e4
        return logits


def scripted(tokenizer, script: list[int], prompt: list[int]) -> ScriptedGPT:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      max_seq_len=128)
    return ScriptedGPT(cfg, script, len(prompt)).eval()


PROMPTS = [[5, 17, 300, 42, 9], [7, 8], [100, 200, 300, 400, 500, 1, 2, 3, 4, 5, 6, 7]]


def full_recompute(model, prompts, cfg: SamplingConfig) -> list[list[int]]:
    """The reference the engine's cache is checked against: greedy, every step recomputing the whole sequence
    from scratch, one prompt at a time, the repetition penalty applied by hand."""
    out = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(cfg.max_new_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([ids]))[0, -1].float()
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[torch.tensor(ids)] = True
            ids.append(int(apply_repetition_penalty(logits, seen, cfg.repetition_penalty).argmax()))
        out.append(ids[len(prompt):])
    return out


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.tensor(sample_rows(logits, [RowSampling(cfg, generator)] * len(logits)).tokens)


# ---------------------------------------------------------------------------------------------- the cache


def test_cache_matches_full_recompute_on_trained_run(trained):
    model, tok = trained
    prompts = [tok.encode("Once upon a time"), tok.encode(CHINESE)]
    for cfg in (GREEDY, SamplingConfig(temperature=0, max_new_tokens=40, repetition_penalty=1.3)):
        with_cache = generate(model, prompts, cfg)
        without = full_recompute(model, prompts, cfg)
        assert with_cache == without
        assert all(len(row) == 40 for row in with_cache)


def test_cache_matches_full_recompute_on_random_model():
    model = random_model()
    with_cache = generate(model, PROMPTS, GREEDY)
    assert with_cache == full_recompute(model, PROMPTS, GREEDY)
    assert len(set(with_cache[0])) > 5, "the check is only meaningful if the text varies"


def test_batch_of_different_lengths_equals_each_prompt_alone(trained):
    model = random_model()
    batched = generate(model, PROMPTS, GREEDY)
    assert batched == [generate(model, [p], GREEDY)[0] for p in PROMPTS]
    model, tok = trained
    prompts = [tok.encode("Once upon a time there was"), tok.encode("我们"), tok.encode("The quick brown fox")]
    cfg = SamplingConfig(temperature=0, max_new_tokens=20, repetition_penalty=1.3)
    assert generate(model, prompts, cfg) == [generate(model, [p], cfg)[0] for p in prompts]


# ---------------------------------------------------------------------------------------------- stopping


def test_stop_token_ends_the_reply_and_is_not_returned(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = tok.encode("Say:")
    for stop in (tok.eos_id, tok.im_end_id):
        reply = tok.encode("Hello world")
        model = scripted(tok, reply + [stop] + tok.encode(" and more"), prompt)
        out = generate(model, [prompt], GREEDY, stop_ids=[tok.eos_id, tok.im_end_id])
        assert out == [reply]
        done = complete(model, tok, [prompt], GREEDY, stop_ids=[tok.eos_id, tok.im_end_id])[0]
        assert (done.text, done.finish_reason) == ("Hello world", "stop")


def test_each_row_stops_on_its_own():
    model = random_model()
    free = generate(model, PROMPTS[:2], GREEDY)
    k = next(i for i, t in enumerate(free[0]) if t not in free[0][:i] and i >= 3)
    stop = free[0][k]
    out = generate(model, PROMPTS[:2], GREEDY, stop_ids=[stop])
    assert out[0] == free[0][:k]
    other = free[1].index(stop) if stop in free[1] else len(free[1])
    assert out[1] == free[1][:other]
    assert all(stop not in row for row in out)


def test_stop_string_cuts_the_text(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = tok.encode("Say:")
    model = scripted(tok, tok.encode("Hello world. STOP here and on"), prompt)
    cfg = SamplingConfig(temperature=0, max_new_tokens=30, stop_strings=["STOP", "never"])
    done = complete(model, tok, [prompt], cfg)[0]
    assert (done.text, done.finish_reason) == ("Hello world. ", "stop")
    ids = generate(model, [prompt], cfg, tokenizer=tok)[0]
    assert "STOP" in tok.decode(ids) and "STOP" not in tok.decode(ids[:-1]), "stops at the completing token"
    with pytest.raises(NanoforgeError, match="tokenizer"):
        generate(model, [prompt], cfg)
    assert cut_at_stop("a STOP b never", ["never", "STOP"]) == "a "


def test_max_new_tokens_and_the_context_limit():
    model = random_model()
    cfg = SamplingConfig(temperature=0, max_new_tokens=7)
    assert [len(r) for r in generate(model, PROMPTS, cfg)] == [7, 7, 7]
    long_prompt = list(range(1, 121))  # 120 of the model's 128 positions
    out = generate(model, [long_prompt], SamplingConfig(temperature=0, max_new_tokens=50))
    assert len(out[0]) == 8, "prompt + reply never exceed the model's positions"


def test_prompt_problems_are_clear_errors():
    model = random_model()
    with pytest.raises(NanoforgeError, match="at most 128"):
        generate(model, [list(range(1, 129))], GREEDY)
    with pytest.raises(NanoforgeError, match="empty"):
        generate(model, [[1, 2], []], GREEDY)
    with pytest.raises(NanoforgeError, match="vocabulary of 512"):
        generate(model, [[1, 600]], GREEDY)
    with pytest.raises(NanoforgeError, match="precision"):
        generate(model, [[1, 2]], GREEDY, precision="int8")
    assert generate(model, [], GREEDY) == []


# ---------------------------------------------------------------------------------------------- sampling


def test_temperature_zero_is_argmax_and_ignores_the_filters():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    cfg = SamplingConfig(temperature=0, top_k=5, top_p=0.5)
    assert torch.equal(sample_next(logits, cfg), logits.argmax(-1))


def test_top_k_one_and_tiny_top_p_equal_greedy():
    model = random_model()
    greedy = generate(model, PROMPTS, GREEDY)
    for cfg in (SamplingConfig(temperature=1.5, top_k=1, max_new_tokens=40, seed=3),
                SamplingConfig(temperature=1.5, top_p=1e-6, max_new_tokens=40, seed=3)):
        assert generate(model, PROMPTS, cfg) == greedy


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    drawn = {int(sample_next(logits, SamplingConfig(top_k=2), torch.Generator().manual_seed(s))) for s in range(200)}
    assert drawn == {0, 1}
    probs = torch.softmax(logits, -1)[0]  # 0.64, 0.24, 0.09, ...: top_p=0.8 needs the first two
    assert probs[0] < 0.8 < probs[0] + probs[1]
    drawn = {int(sample_next(logits, SamplingConfig(top_p=0.8), torch.Generator().manual_seed(s))) for s in range(200)}
    assert drawn == {0, 1}


def test_seed_makes_sampling_reproducible_and_private():
    model = random_model()
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=30, seed=1234)
    torch.manual_seed(1)
    first = generate(model, PROMPTS, cfg)
    torch.manual_seed(2)
    state = torch.get_rng_state()
    assert generate(model, PROMPTS, cfg) == first
    assert torch.equal(torch.get_rng_state(), state), "a seeded call must not touch the global RNG"
    assert generate(model, PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=30, seed=99)) != first


def test_repetition_penalty_never_raises_a_seen_token():
    logits = torch.tensor([[2.0, -2.0, 0.5, -0.5, 0.0, 3.0]])
    seen = torch.tensor([[True, True, True, True, True, False]])
    out = apply_repetition_penalty(logits, seen, 1.5)
    assert torch.all(out[seen] <= logits[seen])
    assert torch.allclose(out, torch.tensor([[2 / 1.5, -3.0, 0.5 / 1.5, -0.75, 0.0, 3.0]]))


def test_repetition_penalty_changes_the_output(trained):
    model, tok = trained
    prompt = [tok.encode("Once upon a time")]
    plain = generate(model, prompt, GREEDY)[0]
    penalized = generate(model, prompt, SamplingConfig(temperature=0, max_new_tokens=40, repetition_penalty=1.5))[0]
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain))


def test_sampling_config_rejects_bad_values():
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_k=1.5), dict(top_p=0), dict(top_p=1.5),
                dict(repetition_penalty=0), dict(max_new_tokens=0), dict(stop_strings="###"),
                dict(stop_strings=[""]), dict(seed="x"), dict(temperature=float("nan")), dict(top_p=float("nan")),
                dict(repetition_penalty=float("inf"))):
        with pytest.raises(NanoforgeError):
            SamplingConfig(**bad)


# ---------------------------------------------------------------------------------------------- streaming


def _check_stream(model, tok, prompt, cfg, stop_ids):
    pieces = list(stream(model, tok, prompt, cfg, stop_ids))
    expected = complete(model, tok, [prompt], cfg, stop_ids)[0].text
    assert "".join(pieces) == expected
    assert all(pieces), "no empty pieces"
    return pieces


def test_stream_joins_to_the_generated_text_with_split_chinese_characters(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = tok.encode("写:")
    reply = tok.encode(SPLIT_CHINESE)
    assert any("\ufffd" in tok.decode(reply[:i]) for i in range(1, len(reply))), "the test needs split characters"
    model = scripted(tok, reply + [tok.eos_id], prompt)
    pieces = _check_stream(model, tok, prompt, GREEDY, [tok.eos_id])
    assert "".join(pieces) == SPLIT_CHINESE
    assert len(pieces) > 3 and not any("\ufffd" in p for p in pieces)


def test_stream_never_shows_any_part_of_a_stop_string(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = tok.encode("写:")
    model = scripted(tok, tok.encode(CHINESE + " Hello"), prompt)
    for stops, expected in ((["小河里"], "春天来了，"), (["冰化", "Hel"], "春天来了，小河里的"),
                            (["。 H"], "春天来了，小河里的冰化了"), (["nowhere"], CHINESE + " Hello")):
        cfg = SamplingConfig(temperature=0, max_new_tokens=len(tok.encode(CHINESE + " Hello")), stop_strings=stops)
        shown = ""
        for piece in stream(model, tok, prompt, cfg, [tok.eos_id]):
            shown += piece
            assert expected.startswith(shown), f"showed {shown!r}, past the stop string of {expected!r}"
        assert shown == expected


def test_stream_equals_complete_on_sampled_text(trained):
    model, tok = trained
    for text in ("Once upon a time", CHINESE):
        cfg = SamplingConfig(temperature=1.0, top_k=50, max_new_tokens=40, seed=7, stop_strings=["the"])
        _check_stream(model, tok, tok.encode(text), cfg, [tok.eos_id])


def test_generation_restores_model_mode_and_leaves_no_inference_mode_on():
    model = random_model().train()
    generate(model, PROMPTS, GREEDY)
    assert model.training
    pieces = stream(model, _ByteTokenizer(), [1, 2, 3], GREEDY)
    next(pieces)
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled() and model.training
    pieces.close()


def test_bf16_autocast_runs():
    model = random_model()
    out = generate(model, PROMPTS, SamplingConfig(temperature=0, max_new_tokens=5), precision="bf16")
    assert [len(r) for r in out] == [5, 5, 5]


class _ByteTokenizer:
    """Decodes each id as one printable ASCII character: enough of a tokenizer for tests that don't look at the text."""

    def decode(self, ids):
        return "".join(chr(32 + i % 90) for i in ids)
